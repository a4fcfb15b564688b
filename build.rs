//! Build script: gives the shared library its SONAME and generates the C header.
//!
//! The header is always generated into `OUT_DIR`. It is written to `include/rdmabridge.h` only
//! when `RDMABRIDGE_UPDATE_HEADER=1` is set (`scripts/regen-header.sh`); the test
//! `header_is_fresh` fails when the committed header differs from the generated one.

use std::{env, fs, path::PathBuf};

fn main() {
    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "linux" {
        // The SONAME is the file cargo writes, so a program linked against the build output
        // with `-lrdmabridge` finds it there at run time. An installed, versioned library
        // (`librdmabridge.so.0` and the usual symlink chain) is built with
        // RDMABRIDGE_SONAME=librdmabridge.so.0.
        let soname =
            env::var("RDMABRIDGE_SONAME").unwrap_or_else(|_| "librdmabridge.so".to_owned());
        assert!(
            soname.starts_with("librdmabridge.so") && !soname.contains(char::is_whitespace),
            "RDMABRIDGE_SONAME={soname:?} is not a librdmabridge.so name"
        );
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    }
    println!("cargo:rerun-if-env-changed=RDMABRIDGE_SONAME");
    println!("cargo:rerun-if-changed=src/ffi");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-env-changed=RDMABRIDGE_UPDATE_HEADER");

    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("cbindgen.toml is readable and valid");
    let generated = out_dir.join("rdmabridge.h");
    match cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
    {
        Ok(bindings) => {
            bindings.write_to_file(&generated);
        }
        Err(e) => {
            // A header that cannot be generated is a build failure, not a warning.
            panic!("cbindgen failed to generate include/rdmabridge.h: {e}");
        }
    }
    if env::var("RDMABRIDGE_UPDATE_HEADER").as_deref() == Ok("1") {
        let dest = crate_dir.join("include").join("rdmabridge.h");
        fs::create_dir_all(dest.parent().expect("include/ has a parent")).expect("create include/");
        fs::copy(&generated, &dest).expect("write include/rdmabridge.h");
    }
}
