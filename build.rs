//! With the `vulkan` feature: translates the `pixels` engine's compute shader
//! (kernels/pixels.wgsl) into SPIR-V with naga, validated, into `$OUT_DIR/pixels.spv`
//! (src/envs/pixels.rs includes it). Without it the file is empty: that build refuses
//! the `pixels` engine (`VulkanUnavailable`) before any shader is made, and the env's
//! source needs no feature of its own. Nothing outside Cargo is run or downloaded.
//! With the `loom` feature: `cfg(loom)` for this crate (src/primitive.rs).
//! With the `mujoco` feature: run paths to libmujoco.so for what links it (docs/mujoco.md).

fn main() {
    println!("cargo:rerun-if-changed=kernels/pixels.wgsl");
    println!("cargo:rerun-if-changed=build.rs");
    // The `loom` feature: `cfg(loom)` for this crate only (see Cargo.toml).
    if std::env::var_os("CARGO_FEATURE_LOOM").is_some() {
        println!("cargo:rustc-cfg=loom");
    }
    // The `mujoco` feature: the loader finds libmujoco.so.3.17.0 next to the extension
    // module (site-packages/mujoco/, the `mujoco` wheel's) or where it was linked from.
    if std::env::var_os("CARGO_FEATURE_MUJOCO").is_some() {
        println!("cargo:rerun-if-env-changed=MUJOCO_DYNAMIC_LINK_DIR");
        println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../mujoco");
        if let Some(dir) = std::env::var_os("MUJOCO_DYNAMIC_LINK_DIR") {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.to_string_lossy());
        }
    }
    #[cfg(feature = "vulkan")]
    pixels_spirv();
    #[cfg(not(feature = "vulkan"))]
    {
        let out = std::path::Path::new(&std::env::var("OUT_DIR").unwrap()).join("pixels.spv");
        std::fs::write(&out, []).unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
    }
}

#[cfg(feature = "vulkan")]
fn pixels_spirv() {
    use naga::back::spv;
    use naga::valid::{Capabilities, ValidationFlags, Validator};

    let path = "kernels/pixels.wgsl";
    let source = std::fs::read_to_string(path).expect("kernels/pixels.wgsl is part of the crate");
    let module = naga::front::wgsl::parse_str(&source)
        .unwrap_or_else(|e| panic!("{}", e.emit_to_string_with_path(&source, path)));
    let info = Validator::new(ValidationFlags::all(), Capabilities::empty())
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}", e.emit_to_string_with_path(&source, path)));
    let options = spv::Options {
        // SPIR-V 1.0: every Vulkan 1.1 device takes it.
        lang_version: (1, 0),
        flags: spv::WriterFlags::empty(),
        ..spv::Options::default()
    };
    let pipeline = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".into(),
    };
    let words = spv::write_vec(&module, &info, &options, Some(&pipeline))
        .unwrap_or_else(|e| panic!("translating {path} to SPIR-V: {e}"));
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let out = std::path::Path::new(&std::env::var("OUT_DIR").unwrap()).join("pixels.spv");
    std::fs::write(&out, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
}
