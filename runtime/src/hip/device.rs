//! Reading a HIP device's architecture name across ROCm ABI versions.
//!
//! The gfx architecture (`gcnArchName`, e.g. `gfx90a:sramecc+:xnack-`) is only
//! available inside `hipDeviceProp_t`, whose layout changed in ROCm 6.0: the
//! 6.x struct is filled by `hipGetDevicePropertiesR0600` (the header maps
//! `hipGetDeviceProperties` to it), while the exported `hipGetDeviceProperties`
//! symbol keeps the pre-6.0 layout for old binaries. kiln looks the symbols up
//! at run time, so one build works with either ROCm: R0600 when the library
//! exports it, the old entry point otherwise, each read at its own offset.
//! The offsets are the ones LLVM's `offload-arch` tool uses; the pre-6.0 one is
//! also checked against hip-sys's bindings in CI.
//!
//! Not here: the calls themselves (ROCm-only backend).

/// Which `hipDeviceProp_t` layout a properties call filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PropsLayout {
    /// ROCm >= 6.0, `hipGetDevicePropertiesR0600`.
    R0600,
    /// ROCm < 6.0 (and the compatibility `hipGetDeviceProperties` of 6.x).
    R0000,
}

/// Bytes kiln hands to the properties call: larger than either layout
/// (1472 and 1676 bytes respectively), so a newer, longer struct is safe too.
pub const PROPS_BUFFER_BYTES: usize = 8192;

/// Length of the `gcnArchName` field.
pub const GCN_ARCH_NAME_BYTES: usize = 256;

impl PropsLayout {
    /// The entry point that fills this layout (NUL-terminated for dlsym).
    pub fn symbol(self) -> &'static [u8] {
        match self {
            PropsLayout::R0600 => b"hipGetDevicePropertiesR0600\0",
            PropsLayout::R0000 => b"hipGetDeviceProperties\0",
        }
    }

    /// Byte offset of `gcnArchName` in the struct.
    pub fn gcn_arch_name_offset(self) -> usize {
        match self {
            PropsLayout::R0600 => 1160,
            PropsLayout::R0000 => 396,
        }
    }
}

/// The `gcnArchName` of a properties buffer filled with `layout`.
pub fn gcn_arch_name(props: &[u8], layout: PropsLayout) -> Result<String, String> {
    let start = layout.gcn_arch_name_offset();
    let field = props
        .get(start..start + GCN_ARCH_NAME_BYTES)
        .ok_or_else(|| {
            format!(
                "device properties buffer of {} bytes is too short",
                props.len()
            )
        })?;
    let len = field.iter().position(|&b| b == 0).ok_or_else(|| {
        format!("gcnArchName read with the {layout:?} layout is not NUL-terminated")
    })?;
    let name =
        std::str::from_utf8(&field[..len]).map_err(|_| "gcnArchName is not UTF-8".to_string())?;
    let base = crate::hip::policy::base_arch(name);
    if base.len() > 3 && base.starts_with("gfx") && base.bytes().all(|c| c.is_ascii_alphanumeric())
    {
        Ok(name.to_string())
    } else {
        Err(format!(
            "gcnArchName `{}` read with the {layout:?} layout is not a gfx architecture; this HIP runtime's hipDeviceProp_t layout is not one kiln knows",
            name.escape_debug()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props_with(layout: PropsLayout, name: &[u8]) -> Vec<u8> {
        // Non-zero filler everywhere else, as a real struct would have.
        let mut v: Vec<u8> = (0..PROPS_BUFFER_BYTES)
            .map(|i| (i * 31 % 251) as u8 | 1)
            .collect();
        let o = layout.gcn_arch_name_offset();
        v[o..o + GCN_ARCH_NAME_BYTES].fill(0);
        v[o..o + name.len()].copy_from_slice(name);
        v
    }

    #[test]
    fn the_arch_name_is_read_at_each_layouts_offset() {
        for layout in [PropsLayout::R0600, PropsLayout::R0000] {
            for name in [
                "gfx90a:sramecc+:xnack-",
                "gfx1100",
                "gfx942:sramecc+:xnack-",
            ] {
                let props = props_with(layout, name.as_bytes());
                assert_eq!(gcn_arch_name(&props, layout).unwrap(), name);
            }
        }
    }

    #[test]
    fn reading_with_the_wrong_layout_is_an_error_not_a_bogus_arch() {
        let props = props_with(PropsLayout::R0600, b"gfx942:sramecc+:xnack-");
        let e = gcn_arch_name(&props, PropsLayout::R0000).unwrap_err();
        assert!(e.contains("R0000"), "{e}");
    }

    #[test]
    fn unterminated_short_or_foreign_names_are_errors() {
        let mut props = props_with(PropsLayout::R0000, b"gfx90a");
        let o = PropsLayout::R0000.gcn_arch_name_offset();
        props[o..o + GCN_ARCH_NAME_BYTES].fill(b'g');
        assert!(gcn_arch_name(&props, PropsLayout::R0000)
            .unwrap_err()
            .contains("NUL"));
        assert!(gcn_arch_name(&props[..500], PropsLayout::R0000)
            .unwrap_err()
            .contains("too short"));
        let props = props_with(PropsLayout::R0000, b"sm_90");
        assert!(gcn_arch_name(&props, PropsLayout::R0000).is_err());
        let props = props_with(PropsLayout::R0000, b"");
        assert!(gcn_arch_name(&props, PropsLayout::R0000).is_err());
    }

    /// hip-sys's bindings were generated from HIP 5.4 headers: the pre-6.0
    /// layout. Its `gcnArchName` must sit where kiln reads it.
    #[cfg(feature = "rocm")]
    #[test]
    fn the_pre_6_0_offset_matches_hip_sys_bindings() {
        use hip_sys::hiprt::hipDeviceProp_t;
        assert_eq!(
            std::mem::offset_of!(hipDeviceProp_t, gcnArchName),
            PropsLayout::R0000.gcn_arch_name_offset()
        );
        assert!(std::mem::size_of::<hipDeviceProp_t>() < PROPS_BUFFER_BYTES);
    }
}
