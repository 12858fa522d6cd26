# Compiles every .java file under SOURCE_DIRS (":"-separated) into CLASSES_DIR with JAVAC, against CLASSPATH
# (":"-separated, may be empty); then, when JAR_FILE is given, packs CLASSES_DIR into it with JAR.
# A script rather than add_jar because SWIG's generated file list is known only after SWIG has run.
#   cmake -DJAVAC=... -DSOURCE_DIRS=... -DCLASSES_DIR=... [-DCLASSPATH=...] [-DJAR=... -DJAR_FILE=...] -P this
string(REPLACE ":" ";" source_dirs "${SOURCE_DIRS}")
set(sources)
foreach(dir IN LISTS source_dirs)
  file(GLOB_RECURSE found "${dir}/*.java")
  list(APPEND sources ${found})
endforeach()
if(NOT sources)
  message(FATAL_ERROR "compile_java: no .java files under ${SOURCE_DIRS}")
endif()
list(SORT sources)

file(REMOVE_RECURSE "${CLASSES_DIR}")
file(MAKE_DIRECTORY "${CLASSES_DIR}")
set(classpath_args)
if(CLASSPATH)
  set(classpath_args -cp "${CLASSPATH}")
endif()
execute_process(
  COMMAND "${JAVAC}" -encoding UTF-8 --release 17 -Xlint:all -d "${CLASSES_DIR}" ${classpath_args} ${sources}
  RESULT_VARIABLE javac_result)
if(NOT javac_result EQUAL 0)
  message(FATAL_ERROR "compile_java: javac failed (${javac_result})")
endif()

if(JAR_FILE)
  execute_process(COMMAND "${JAR}" cf "${JAR_FILE}" -C "${CLASSES_DIR}" . RESULT_VARIABLE jar_result)
  if(NOT jar_result EQUAL 0)
    message(FATAL_ERROR "compile_java: jar failed (${jar_result})")
  endif()
endif()
