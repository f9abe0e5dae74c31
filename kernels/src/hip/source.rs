//! One HIP translation unit from kiln's GPU kernel sources.
//!
//! The kernels are written once for CUDA and HIP (`kernels/gpu/*.cu` plus the
//! portability header `kiln_port.h`). hiprtc compiles a single source string
//! and cannot open files, and a plan stores a HIP module as one image, so the
//! sources are concatenated into one translation unit: the header once at the
//! top, then every source with its `#include "kiln_port.h"` line blanked out.
//! `#line` directives keep compiler messages pointing at the original file and
//! line. The output is deterministic (same inputs, same bytes), because it is
//! hashed into the kernel cache key and embedded in plans.
//!
//! Not here: compiling the unit (hiprtc at load, hipcc at compile time) and the
//! catalog that lists the sources (`kiln_kernels`).

use std::collections::BTreeSet;

/// The portability header every kernel source includes.
pub const PORT_HEADER: &str = "kiln_port.h";

/// A named source text.
#[derive(Clone, Copy, Debug)]
pub struct SourceText<'a> {
    /// File name as it should appear in compiler messages (`rms_norm.cu`).
    pub name: &'a str,
    pub text: &'a str,
}

/// Why the sources cannot be made into one translation unit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    #[error("{file}:{line}: `#include \"{header}\"` cannot be resolved in a single HIP translation unit; kernel sources may include only \"{PORT_HEADER}\" (put shared code there) and system headers <...>")]
    LocalInclude {
        file: String,
        line: usize,
        header: String,
    },
    #[error("kernel source `{0}` is listed twice; every source must have a distinct name")]
    DuplicateName(String),
    #[error("kernel source name `{0}` is not a plain file name (letters, digits, `_`, `-`, `.`); it appears in #line directives")]
    BadName(String),
    #[error("no kernel sources given: a HIP module needs at least one")]
    Empty,
}

/// The target of an `#include` directive on this line, if it is one:
/// `Some((true, name))` for `"name"`, `Some((false, name))` for `<name>`.
fn include_target(line: &str) -> Option<(bool, &str)> {
    let rest = line.trim_start().strip_prefix('#')?.trim_start();
    let rest = rest.strip_prefix("include")?.trim_start();
    if let Some(r) = rest.strip_prefix('"') {
        return r.split_once('"').map(|(name, _)| (true, name));
    }
    if let Some(r) = rest.strip_prefix('<') {
        return r.split_once('>').map(|(name, _)| (false, name));
    }
    None
}

fn check_name(name: &str) -> Result<(), SourceError> {
    let ok = !name.is_empty()
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(SourceError::BadName(name.to_string()))
    }
}

/// Appends `file` with `#line` bookkeeping, blanking `#include "kiln_port.h"`
/// and refusing any other local include.
fn append_file(
    out: &mut String,
    file: &SourceText<'_>,
    is_header: bool,
) -> Result<(), SourceError> {
    out.push_str(&format!("#line 1 \"{}\"\n", file.name));
    for (i, line) in file.text.lines().enumerate() {
        if is_header && line.trim() == "#pragma once" {
            // In the main file clang warns about it; the header is pasted once anyway.
            out.push_str("// kiln: #pragma once dropped (the header appears once in this unit)\n");
            continue;
        }
        match include_target(line) {
            Some((true, header)) if header == PORT_HEADER => {
                // Keep the line count so `#line` stays right.
                out.push_str("// kiln: kiln_port.h is included once at the top of this unit\n");
            }
            Some((true, header)) => {
                return Err(SourceError::LocalInclude {
                    file: file.name.to_string(),
                    line: i + 1,
                    header: header.to_string(),
                })
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    Ok(())
}

/// Builds the translation unit: `header` (the portability header) once, then
/// `sources` in the order given.
pub fn translation_unit(
    header: &SourceText<'_>,
    sources: &[SourceText<'_>],
) -> Result<String, SourceError> {
    if sources.is_empty() {
        return Err(SourceError::Empty);
    }
    let mut seen = BTreeSet::new();
    for s in std::iter::once(header).chain(sources) {
        check_name(s.name)?;
        if !seen.insert(s.name) {
            return Err(SourceError::DuplicateName(s.name.to_string()));
        }
    }
    let mut out = String::new();
    out.push_str("// kiln: HIP translation unit generated from ");
    out.push_str(header.name);
    for s in sources {
        out.push_str(", ");
        out.push_str(s.name);
    }
    out.push_str(". Do not edit: edit the sources.\n");
    append_file(&mut out, header, true)?;
    for s in sources {
        append_file(&mut out, s, false)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str =
        "#pragma once\n#include <hip/hip_runtime.h>\n#define KILN_DEVICE __device__\n";

    fn src<'a>(name: &'a str, text: &'a str) -> SourceText<'a> {
        SourceText { name, text }
    }

    #[test]
    fn the_header_appears_once_and_each_source_in_order() {
        let a = "#include \"kiln_port.h\"\nextern \"C\" __global__ void add_f32() {}\n";
        let b = "  #  include   \"kiln_port.h\"\nextern \"C\" __global__ void argmax_f32() {}";
        let tu = translation_unit(
            &src("kiln_port.h", HEADER),
            &[src("add.cu", a), src("argmax.cu", b)],
        )
        .unwrap();
        assert_eq!(tu.matches("#define KILN_DEVICE").count(), 1, "{tu}");
        assert!(
            !tu.lines()
                .any(|l| include_target(l) == Some((true, PORT_HEADER))),
            "{tu}"
        );
        let add = tu.find("add_f32").unwrap();
        let argmax = tu.find("argmax_f32").unwrap();
        let header = tu.find("KILN_DEVICE").unwrap();
        assert!(header < add && add < argmax);
        // System includes are left for the compiler.
        assert!(tu.contains("#include <hip/hip_runtime.h>"));
        assert!(tu.ends_with('\n'));
    }

    #[test]
    fn line_directives_map_every_line_back_to_its_file() {
        // Walk the unit as a preprocessor would, and check that each emitted
        // line is the claimed line of the claimed file.
        let files = [
            src("kiln_port.h", HEADER),
            src("a.cu", "#include \"kiln_port.h\"\nint a1;\n\nint a3;\n"),
            src("b.cu", "int b0;\n#include \"kiln_port.h\"\nint b2;"),
        ];
        let tu = translation_unit(&files[0], &files[1..]).unwrap();
        let mut current: Option<(&str, usize)> = None;
        for line in tu.lines().skip(1) {
            if let Some(rest) = line.strip_prefix("#line ") {
                let (n, name) = rest.split_once(' ').unwrap();
                current = Some((name.trim_matches('"'), n.parse().unwrap()));
                continue;
            }
            let (name, n) = current.expect("a #line precedes every line");
            let file = files.iter().find(|f| f.name == name).unwrap();
            let original = file.text.lines().nth(n - 1).unwrap();
            if include_target(original) == Some((true, PORT_HEADER)) || original == "#pragma once" {
                assert!(line.starts_with("//"), "{line}");
            } else {
                assert_eq!(line, original, "{name}:{n}");
            }
            current = Some((name, n + 1));
        }
    }

    #[test]
    fn the_unit_is_deterministic_and_depends_on_every_input() {
        let h = src("kiln_port.h", HEADER);
        let a = src("a.cu", "int a;\n");
        let b = src("b.cu", "int b;\n");
        let ab = translation_unit(&h, &[a, b]).unwrap();
        assert_eq!(ab, translation_unit(&h, &[a, b]).unwrap());
        assert_ne!(ab, translation_unit(&h, &[b, a]).unwrap());
        assert_ne!(
            ab,
            translation_unit(&h, &[a, src("b.cu", "int c;\n")]).unwrap()
        );
        assert_ne!(
            ab,
            translation_unit(&src("kiln_port.h", "#pragma once\n"), &[a, b]).unwrap()
        );
    }

    #[test]
    fn a_local_include_other_than_the_port_header_is_refused_with_file_and_line() {
        let e = translation_unit(
            &src("kiln_port.h", HEADER),
            &[
                src("ok.cu", "int x;\n"),
                src("bad.cu", "int y;\n\n#include \"helpers.cuh\"\n"),
            ],
        )
        .unwrap_err();
        assert_eq!(
            e,
            SourceError::LocalInclude {
                file: "bad.cu".into(),
                line: 3,
                header: "helpers.cuh".into()
            }
        );
        assert!(e.to_string().starts_with("bad.cu:3:"), "{e}");
        // The header is checked too.
        let e = translation_unit(
            &src("kiln_port.h", "#include \"x.h\"\n"),
            &[src("a.cu", "")],
        )
        .unwrap_err();
        assert!(matches!(e, SourceError::LocalInclude { ref file, .. } if file == "kiln_port.h"));
    }

    #[test]
    fn duplicate_bad_or_missing_names_are_refused() {
        let h = src("kiln_port.h", HEADER);
        assert_eq!(
            translation_unit(&h, &[src("a.cu", ""), src("a.cu", "")]).unwrap_err(),
            SourceError::DuplicateName("a.cu".into())
        );
        assert_eq!(
            translation_unit(&h, &[src("kiln_port.h", "")]).unwrap_err(),
            SourceError::DuplicateName("kiln_port.h".into())
        );
        assert_eq!(
            translation_unit(&h, &[src("a\"b.cu", "")]).unwrap_err(),
            SourceError::BadName("a\"b.cu".into())
        );
        assert_eq!(translation_unit(&h, &[]).unwrap_err(), SourceError::Empty);
    }

    #[test]
    fn include_parsing_handles_spacing_and_both_forms() {
        assert_eq!(include_target("#include \"a.h\""), Some((true, "a.h")));
        assert_eq!(include_target("  #   include<b.h>"), Some((false, "b.h")));
        assert_eq!(include_target("// #include \"a.h\""), None);
        assert_eq!(include_target("#define include"), None);
        assert_eq!(include_target("#include MACRO"), None);
    }
}
