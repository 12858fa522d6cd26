// Tells rustc where libsparsa is; the bindings themselves are committed (src/bindings.rs), not generated here.
// In order:
//   1. SPARSA_LIB_DIR: a folder holding libsparsa.so (a build tree such as build/cpu, or <prefix>/lib);
//   2. pkg-config: `pkg-config --libs-only-L sparsa` (PKG_CONFIG_PATH at <prefix>/lib/pkgconfig or at a build
//      tree's pkgconfig/ folder); a package found with no -L (installed in a system folder) needs no search path.
// Neither: the build stops with one line saying what was looked for. No crates.io dependency (no pkg-config crate):
// the pkg-config program is run directly.
use std::path::Path;
use std::process::Command;

const LIB_DIR_VAR: &str = "SPARSA_LIB_DIR";
const LIBRARY_FILE: &str = "libsparsa.so";

fn fail(message: &str) -> ! {
    // cargo shows a build script's stderr on failure; one line, then a non-zero exit.
    eprintln!("error: sparsa-sys: {message}");
    std::process::exit(1);
}

fn from_pkg_config() -> Result<Vec<String>, String> {
    let program = std::env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".to_string());
    let output = Command::new(&program)
        .args(["--libs-only-L", "sparsa"])
        .output()
        .map_err(|e| format!("`{program}` could not run ({e})"))?;
    if !output.status.success() {
        let path = std::env::var("PKG_CONFIG_PATH").unwrap_or_default();
        return Err(format!("`{program} sparsa` found no sparsa.pc (PKG_CONFIG_PATH={path:?})"));
    }
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    Ok(text
        .split_whitespace()
        .filter_map(|flag| flag.strip_prefix("-L").map(str::to_string))
        .collect())
}

fn main() {
    println!("cargo:rerun-if-env-changed={LIB_DIR_VAR}");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG");
    match std::env::var(LIB_DIR_VAR) {
        Ok(dir) if !dir.is_empty() => {
            if !Path::new(&dir).join(LIBRARY_FILE).exists() {
                fail(&format!("{LIB_DIR_VAR}={dir} holds no {LIBRARY_FILE} (build sparsa there first)"));
            }
            println!("cargo:rustc-link-search=native={dir}");
            println!("cargo:root={dir}");
        }
        _ => match from_pkg_config() {
            Ok(dirs) => {
                for dir in &dirs {
                    println!("cargo:rustc-link-search=native={dir}");
                }
                if let Some(dir) = dirs.first() {
                    println!("cargo:root={dir}");
                }
            }
            Err(why) => fail(&format!(
                "cannot find libsparsa: {LIB_DIR_VAR} is not set and {why}; set {LIB_DIR_VAR} to the folder \
                 holding {LIBRARY_FILE} or PKG_CONFIG_PATH to the folder holding sparsa.pc"
            )),
        },
    }
    println!("cargo:rustc-link-lib=dylib=sparsa");
}
