// Only tells rustc where libsparsa is: SPARSA_LIB_DIR (set by CMake to the build tree's library folder), else the
// system linker path. The bindings themselves are committed (src/bindings.rs), not generated at build time.
fn main() {
    println!("cargo:rerun-if-env-changed=SPARSA_LIB_DIR");
    if let Ok(dir) = std::env::var("SPARSA_LIB_DIR") {
        println!("cargo:rustc-link-search=native={dir}");
    }
    println!("cargo:rustc-link-lib=dylib=sparsa");
}
