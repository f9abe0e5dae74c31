//! Output paths checked against inputs before any work starts.
//!
//! `kiln compile DIR -o DIR/model.safetensors` would replace the model's own
//! weights with a plan, and `kiln import X.gguf -o X.gguf --force` would delete
//! the input: every command that writes a file or a directory first asks
//! [`check_output`] whether the output is, contains, or lies inside one of
//! its inputs, and refuses with both paths named. Paths are compared after
//! resolving symbolic links and `..` (an output that does not exist yet is
//! resolved through its nearest existing ancestor), so `./m/../m/x` and a
//! link to the model directory are caught too.
//!
//! Deliberately not here: writing (callers write to a temp file beside the
//! output and rename), and permissions (the OS reports those).

use std::path::{Component, Path, PathBuf};

/// An output that would overwrite or delete an input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutputPathError {
    #[error(
        "refusing to write {output}: it is the input {input}; choose another output path (-o)"
    )]
    IsInput { output: PathBuf, input: PathBuf },
    #[error("refusing to write {output}: it lies inside the input {input} and would replace part of it; write the output outside the input (-o)")]
    InsideInput { output: PathBuf, input: PathBuf },
    #[error("refusing to write {output}: the input {input} lies inside it, and replacing the output would delete the input; choose another output path (-o)")]
    ContainsInput { output: PathBuf, input: PathBuf },
}

/// `path` made absolute with links and `..` resolved as far as the path
/// exists; the missing tail is appended lexically.
pub fn resolve(path: &Path) -> PathBuf {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| PathBuf::from("/"))
            .join(path)
    };
    // Lexical normalisation first, so `a/missing/../b` means `a/b`.
    let mut norm = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::ParentDir => {
                norm.pop();
            }
            Component::CurDir => {}
            other => norm.push(other.as_os_str()),
        }
    }
    let mut existing = norm.clone();
    let mut tail = Vec::new();
    loop {
        if let Ok(c) = existing.canonicalize() {
            let mut out = c;
            for t in tail.iter().rev() {
                out.push(t);
            }
            return out;
        }
        match (
            existing.file_name().map(|n| n.to_os_string()),
            existing.parent(),
        ) {
            (Some(name), Some(parent)) => {
                tail.push(name);
                existing = parent.to_path_buf();
            }
            _ => return norm,
        }
    }
}

/// Refuses an output that is an input, lies inside an input directory, or
/// contains an input (so replacing it would delete the input).
pub fn check_output(output: &Path, inputs: &[&Path]) -> Result<(), OutputPathError> {
    let out = resolve(output);
    for input in inputs {
        let inp = resolve(input);
        let named = || (output.to_path_buf(), input.to_path_buf());
        if out == inp {
            let (output, input) = named();
            return Err(OutputPathError::IsInput { output, input });
        }
        if out.starts_with(&inp) {
            let (output, input) = named();
            return Err(OutputPathError::InsideInput { output, input });
        }
        if inp.starts_with(&out) {
            let (output, input) = named();
            return Err(OutputPathError::ContainsInput { output, input });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_inside_the_model_directory_is_refused() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("model.safetensors"), b"w").unwrap();
        let e = check_output(&d.path().join("model.safetensors"), &[d.path()]).unwrap_err();
        assert!(matches!(e, OutputPathError::InsideInput { .. }), "{e}");
        let e = check_output(&d.path().join("new.kiln"), &[d.path()]).unwrap_err();
        assert!(e.to_string().contains("inside the input"), "{e}");
    }

    #[test]
    fn an_output_equal_to_the_input_file_is_refused_even_through_dots_and_links() {
        let d = tempfile::tempdir().unwrap();
        let g = d.path().join("x.gguf");
        std::fs::write(&g, b"gguf").unwrap();
        let dotted = d.path().join("sub/../x.gguf");
        assert!(matches!(
            check_output(&dotted, &[&g]),
            Err(OutputPathError::IsInput { .. })
        ));
        #[cfg(unix)]
        {
            let link = d.path().join("link.gguf");
            std::os::unix::fs::symlink(&g, &link).unwrap();
            assert!(check_output(&link, &[&g]).is_err());
        }
    }

    #[test]
    fn an_output_directory_holding_the_input_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let g = d.path().join("x.gguf");
        std::fs::write(&g, b"gguf").unwrap();
        let e = check_output(d.path(), &[&g]).unwrap_err();
        assert!(matches!(e, OutputPathError::ContainsInput { .. }), "{e}");
    }

    #[test]
    fn an_unrelated_output_is_accepted() {
        let d = tempfile::tempdir().unwrap();
        let model = d.path().join("model");
        std::fs::create_dir(&model).unwrap();
        check_output(&d.path().join("plans/model.kiln"), &[&model]).unwrap();
        // A sibling whose name starts with the input's is not inside it.
        check_output(&d.path().join("model-plan.kiln"), &[&model]).unwrap();
    }
}
