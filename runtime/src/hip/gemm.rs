//! GEMM bookkeeping for hipBLASLt that needs no GPU: the column-major problem
//! a kiln `matmul` becomes, the workspace the BLAS library may use, and the
//! choice among the algorithms its heuristic proposes.
//!
//! Why this is separate: the lazy-workspace hazard (ARCHITECTURE.md, capture
//! contract rule 3) is decided by these functions, so CI tests them without an
//! AMD device. The backend asks hipBLASLt for algorithms with a max-workspace
//! preference equal to the planned figure and then *checks* each answer here
//! (a library that ignored the preference would otherwise allocate inside a
//! capture), and the workspace allocation may not move once a graph holds its
//! address.
//!
//! Not here: the hipBLASLt calls themselves (ROCm-only `blaslt` module).

use crate::backend::{BackendError, DevPtr, Launch};
use kiln_ir::{DType, Key, Op, TensorType};

/// One operand's layout as hipBLASLt sees it (column-major).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatrixLayout {
    pub dtype: DType,
    pub rows: u64,
    pub cols: u64,
    /// Leading dimension: elements between consecutive columns.
    pub ld: i64,
}

/// `D = op(A) * op(B) (+ bias)` in hipBLASLt's column-major terms, with
/// `D` `m x n` and the inner dimension `k`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GemmProblem {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub a: MatrixLayout,
    pub b: MatrixLayout,
    pub d: MatrixLayout,
    /// `op(A) = A^T`.
    pub trans_a: bool,
    /// `op(B) = B^T`.
    pub trans_b: bool,
    /// Bias dtype when the epilogue adds a bias of length `m`.
    pub bias: Option<DType>,
}

/// Device addresses of a GEMM's operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmOperands {
    pub a: DevPtr,
    pub b: DevPtr,
    pub d: DevPtr,
    pub bias: Option<DevPtr>,
}

impl GemmProblem {
    /// Maps kiln's row-major `matmul(x: D[T,K], w: D[N,K] [, bias: D[N]]) ->
    /// out[T,N]` (`out = x @ w^T + bias`) to column-major: a row-major `[R,C]`
    /// buffer is a column-major `C x R` matrix, so `out^T (N x T) = w (stored
    /// K x N, transposed) * x (stored K x T)`, and the bias runs along the
    /// rows of `D` as hipBLASLt's bias epilogue requires.
    pub fn from_matmul(
        x: &TensorType,
        w: &TensorType,
        bias: Option<&TensorType>,
        out: &TensorType,
    ) -> Result<GemmProblem, String> {
        let dims = |t: &TensorType, what: &str| -> Result<(u64, u64), String> {
            match t.shape.dims() {
                [r, c] => Ok((*r as u64, *c as u64)),
                _ => Err(format!("matmul {what} must be 2-D, got {t}")),
            }
        };
        let (t, k) = dims(x, "x")?;
        let (n_out, kw) = dims(w, "weight")?;
        let (ot, on) = dims(out, "result")?;
        if kw != k || ot != t || on != n_out {
            return Err(format!(
                "matmul operands disagree: x {x}, weight {w}, result {out} (expected x [T,K], weight [N,K], result [T,N])"
            ));
        }
        if t == 0 || k == 0 || n_out == 0 {
            return Err(format!("matmul with an empty dimension: x {x}, weight {w}"));
        }
        if let Some(b) = bias {
            if b.shape.dims() != [n_out as u32] {
                return Err(format!("matmul bias {b} must have length {n_out}"));
            }
        }
        Ok(GemmProblem {
            m: n_out,
            n: t,
            k,
            a: MatrixLayout {
                dtype: w.dtype,
                rows: k,
                cols: n_out,
                ld: k as i64,
            },
            b: MatrixLayout {
                dtype: x.dtype,
                rows: k,
                cols: t,
                ld: k as i64,
            },
            d: MatrixLayout {
                dtype: out.dtype,
                rows: n_out,
                cols: t,
                ld: n_out as i64,
            },
            trans_a: true,
            trans_b: false,
            bias: bias.map(|b| b.dtype),
        })
    }

    /// The GEMM of a `matmul` launch and its operand addresses.
    pub fn from_launch(launch: &Launch) -> Result<(GemmProblem, GemmOperands), BackendError> {
        let bad = |message: String| BackendError::Device(format!("{}: {message}", launch.kernel));
        let Op::MatMul { bias, .. } = &launch.op else {
            return Err(bad(format!(
                "`{}` is not a matmul; only matmul runs on hipBLASLt",
                launch.op.mnemonic()
            )));
        };
        let want = if *bias { 3 } else { 2 };
        if launch.args.len() != want || launch.results.len() != 1 {
            return Err(bad(format!(
                "matmul (bias: {bias}) takes {want} arguments and 1 result, got {} and {}",
                launch.args.len(),
                launch.results.len()
            )));
        }
        let types: Vec<TensorType> = launch.args.iter().map(|a| a.ty.clone()).collect();
        let inferred = launch.op.infer(&types).map_err(bad)?;
        if inferred[0] != launch.results[0].ty {
            return Err(bad(format!(
                "result type {} does not match the typing rule's {}",
                launch.results[0].ty, inferred[0]
            )));
        }
        let p = GemmProblem::from_matmul(
            &launch.args[0].ty,
            &launch.args[1].ty,
            launch.args.get(2).map(|b| &b.ty),
            &launch.results[0].ty,
        )
        .map_err(bad)?;
        let ops = GemmOperands {
            a: launch.args[1].ptr,
            b: launch.args[0].ptr,
            d: launch.results[0].ptr,
            bias: launch.args.get(2).map(|b| b.ptr),
        };
        Ok((p, ops))
    }

    /// How errors name this GEMM: the row-major kiln view.
    pub fn describe(&self) -> String {
        let bias = match self.bias {
            Some(d) => format!(" + bias {d}[{}]", self.m),
            None => String::new(),
        };
        format!(
            "matmul x {}[{},{}] @ w {}[{},{}]^T{bias} -> {}[{},{}]",
            self.b.dtype,
            self.n,
            self.k,
            self.a.dtype,
            self.m,
            self.k,
            self.d.dtype,
            self.n,
            self.m
        )
    }
}

/// One algorithm proposed by the BLAS heuristic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlgoCandidate {
    /// Workspace bytes the algorithm needs.
    pub workspace: u64,
    /// The heuristic marked it usable (status success).
    pub usable: bool,
}

/// Picks the first usable candidate (the heuristic orders them fastest
/// first) whose workspace fits in `granted`.
///
/// None usable: a device error naming the GEMM. Usable ones exist but every
/// one needs more than `granted`: [`BackendError::WorkspaceTooSmall`] with the
/// smallest requirement, decided here, before any capture, instead of the
/// library growing its workspace inside one.
pub fn select_algorithm(
    candidates: &[AlgoCandidate],
    granted: u64,
    what: &str,
) -> Result<usize, BackendError> {
    if let Some(i) = candidates
        .iter()
        .position(|c| c.usable && c.workspace <= granted)
    {
        return Ok(i);
    }
    match candidates
        .iter()
        .filter(|c| c.usable)
        .map(|c| c.workspace)
        .min()
    {
        Some(needed) => Err(BackendError::WorkspaceTooSmall {
            what: what.to_string(),
            needed,
            granted,
        }),
        None => Err(BackendError::Device(format!(
            "hipBLASLt proposes no algorithm for {what} on this device ({} candidate(s), none usable); this dtype combination or architecture is not supported by the installed hipBLASLt",
            candidates.len()
        ))),
    }
}

/// How the workspace allocation must change for a reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkspaceChange {
    /// The current allocation already has exactly the requested size.
    Keep,
    /// Nothing allocated yet: allocate this many bytes.
    Allocate(u64),
    /// Free the current allocation of `from` bytes and allocate `to`.
    Reallocate { from: u64, to: u64 },
    /// Free the current allocation (a reservation of 0 bytes).
    Release(u64),
}

/// The BLAS workspace's size and whether a graph already holds its address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkspaceLedger {
    reserved: u64,
    frozen_by: Option<Key>,
}

impl WorkspaceLedger {
    /// Bytes currently reserved (0: none).
    pub fn granted(&self) -> u64 {
        self.reserved
    }

    /// The key whose capture froze the workspace, if any.
    pub fn frozen_by(&self) -> Option<Key> {
        self.frozen_by
    }

    /// What reserving exactly `bytes` requires. Once a capture has taken the
    /// workspace's address, the size (and so the address) may not change.
    pub fn plan(&self, bytes: u64) -> Result<WorkspaceChange, BackendError> {
        if bytes == self.reserved {
            return Ok(WorkspaceChange::Keep);
        }
        if let Some(key) = self.frozen_by {
            return Err(BackendError::Device(format!(
                "the BLAS workspace cannot change from {} to {bytes} bytes: key {key} was captured with its address; reserve the plan's workspace (the maximum over all keys) before the first capture",
                self.reserved
            )));
        }
        Ok(match (self.reserved, bytes) {
            (0, to) => WorkspaceChange::Allocate(to),
            (from, 0) => WorkspaceChange::Release(from),
            (from, to) => WorkspaceChange::Reallocate { from, to },
        })
    }

    /// Records that the reservation of `bytes` took effect.
    pub fn commit(&mut self, bytes: u64) {
        self.reserved = bytes;
    }

    /// Records that a capture of `key` may now hold the workspace address.
    pub fn freeze(&mut self, key: Key) {
        self.frozen_by.get_or_insert(key);
    }

    /// The workspace a GEMM launch may use: the launch's grant, which must lie
    /// inside the reserved allocation `reserved` (its base and size).
    pub fn grant_for(
        &self,
        launch_workspace: Option<(DevPtr, u64)>,
        reserved: Option<(DevPtr, u64)>,
        what: &str,
    ) -> Result<(Option<DevPtr>, u64), BackendError> {
        let Some((ptr, bytes)) = launch_workspace.filter(|(_, b)| *b > 0) else {
            return Ok((None, 0));
        };
        match reserved {
            Some((base, size)) if ptr >= base && ptr.0 + bytes <= base.0 + size => {
                Ok((Some(ptr), bytes))
            }
            _ => Err(BackendError::Device(format!(
                "{what} was given {bytes} bytes of workspace at {:#x}, outside the reserved BLAS workspace ({}); call reserve_workspace with the plan's figure before preparing GEMMs",
                ptr.0,
                match reserved {
                    Some((b, s)) => format!("{s} bytes at {:#x}", b.0),
                    None => "none reserved".to_string(),
                }
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::DevOperand;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn f32(&mut self) -> f32 {
            (self.next() % 2001) as f32 / 1000.0 - 1.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// A naive column-major BLAS: `D = op(A) * op(B) + bias` exactly as
    /// hipBLASLt defines it, reading operands through their layouts.
    fn blas_reference(p: &GemmProblem, a: &[f32], b: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
        let at = |l: &MatrixLayout, buf: &[f32], r: u64, c: u64| {
            buf[(r as i64 + c as i64 * l.ld) as usize]
        };
        let op_a = |i: u64, l: u64| {
            if p.trans_a {
                at(&p.a, a, l, i)
            } else {
                at(&p.a, a, i, l)
            }
        };
        let op_b = |l: u64, j: u64| {
            if p.trans_b {
                at(&p.b, b, j, l)
            } else {
                at(&p.b, b, l, j)
            }
        };
        let mut d = vec![0f32; (p.d.ld as u64 * p.n) as usize];
        for j in 0..p.n {
            for i in 0..p.m {
                let mut s = 0f32;
                for l in 0..p.k {
                    s += op_a(i, l) * op_b(l, j);
                }
                if let Some(bias) = bias {
                    s += bias[i as usize];
                }
                d[(i as i64 + j as i64 * p.d.ld) as usize] = s;
            }
        }
        d
    }

    #[test]
    fn the_column_major_problem_computes_x_times_w_transposed_plus_bias() {
        let mut rng = Rng(0x5eed_1234_abcd_0001);
        for _ in 0..40 {
            let (t, k, n) = (1 + rng.below(9), 1 + rng.below(17), 1 + rng.below(13));
            let with_bias = rng.below(2) == 1;
            let x: Vec<f32> = (0..t * k).map(|_| rng.f32()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
            let bias: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
            let tt = |r: u64, c: u64| TensorType::new(DType::F32, [r as u32, c as u32]);
            let bias_ty = TensorType::new(DType::F32, [n as u32]);
            let p = GemmProblem::from_matmul(
                &tt(t, k),
                &tt(n, k),
                with_bias.then_some(&bias_ty),
                &tt(t, n),
            )
            .unwrap();
            // A is the weight buffer, B the activation buffer, as in from_launch.
            let d = blas_reference(&p, &w, &x, with_bias.then_some(&bias[..]));
            assert_eq!(d.len() as u64, t * n);
            for r in 0..t {
                for c in 0..n {
                    let mut want: f32 = (0..k)
                        .map(|l| x[(r * k + l) as usize] * w[(c * k + l) as usize])
                        .sum();
                    if with_bias {
                        want += bias[c as usize];
                    }
                    let got = d[(r * n + c) as usize];
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "t{t} k{k} n{n} [{r},{c}]: {got} vs {want}"
                    );
                }
            }
        }
    }

    fn launch(op: Op, args: Vec<TensorType>, result: TensorType) -> Launch {
        Launch {
            const_args: 0,
            body: crate::backend::LaunchBody::Reference,
            kernel: "gemm".into(),
            op,
            args: args
                .into_iter()
                .enumerate()
                .map(|(i, ty)| DevOperand {
                    ptr: DevPtr(0x1000 * (i as u64 + 1)),
                    ty,
                })
                .collect(),
            results: vec![DevOperand {
                ptr: DevPtr(0x9000),
                ty: result,
            }],
            workspace: None,
        }
    }

    #[test]
    fn a_launch_maps_weight_to_a_and_activations_to_b() {
        let l = launch(
            Op::MatMul {
                bias: true,
                out: DType::BF16,
            },
            vec![
                TensorType::new(DType::BF16, [8, 576]),
                TensorType::new(DType::BF16, [1536, 576]),
                TensorType::new(DType::BF16, [1536]),
            ],
            TensorType::new(DType::BF16, [8, 1536]),
        );
        let (p, ops) = GemmProblem::from_launch(&l).unwrap();
        assert_eq!((p.m, p.n, p.k), (1536, 8, 576));
        assert_eq!(ops.a, DevPtr(0x2000));
        assert_eq!(ops.b, DevPtr(0x1000));
        assert_eq!(ops.bias, Some(DevPtr(0x3000)));
        assert_eq!(ops.d, DevPtr(0x9000));
        assert_eq!(p.bias, Some(DType::BF16));
        assert_eq!(
            p.describe(),
            "matmul x bf16[8,576] @ w bf16[1536,576]^T + bias bf16[1536] -> bf16[8,1536]"
        );
    }

    #[test]
    fn logits_in_f32_from_bf16_inputs_keep_the_output_dtype() {
        let l = launch(
            Op::MatMul {
                bias: false,
                out: DType::F32,
            },
            vec![
                TensorType::new(DType::BF16, [4, 64]),
                TensorType::new(DType::BF16, [1000, 64]),
            ],
            TensorType::new(DType::F32, [4, 1000]),
        );
        let (p, _) = GemmProblem::from_launch(&l).unwrap();
        assert_eq!(
            (p.a.dtype, p.b.dtype, p.d.dtype),
            (DType::BF16, DType::BF16, DType::F32)
        );
        assert_eq!(p.d.ld, 1000);
        assert_eq!(p.bias, None);
    }

    #[test]
    fn ill_typed_or_non_matmul_launches_are_refused_with_the_kernel_name() {
        let bad_inner = launch(
            Op::MatMul {
                bias: false,
                out: DType::F32,
            },
            vec![
                TensorType::new(DType::F32, [4, 64]),
                TensorType::new(DType::F32, [10, 65]),
            ],
            TensorType::new(DType::F32, [4, 10]),
        );
        let e = GemmProblem::from_launch(&bad_inner)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("gemm:") && e.contains("inner dimension"),
            "{e}"
        );
        let wrong_result = launch(
            Op::MatMul {
                bias: false,
                out: DType::F32,
            },
            vec![
                TensorType::new(DType::F32, [4, 64]),
                TensorType::new(DType::F32, [10, 64]),
            ],
            TensorType::new(DType::BF16, [4, 10]),
        );
        let e = GemmProblem::from_launch(&wrong_result)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not match"), "{e}");
        let add = launch(
            Op::Add,
            vec![
                TensorType::new(DType::F32, [4]),
                TensorType::new(DType::F32, [4]),
            ],
            TensorType::new(DType::F32, [4]),
        );
        let e = GemmProblem::from_launch(&add).unwrap_err().to_string();
        assert!(e.contains("not a matmul"), "{e}");
    }

    fn c(workspace: u64, usable: bool) -> AlgoCandidate {
        AlgoCandidate { workspace, usable }
    }

    #[test]
    fn the_fastest_usable_algorithm_that_fits_is_chosen() {
        let cands = [c(1 << 20, true), c(0, false), c(4096, true), c(0, true)];
        assert_eq!(select_algorithm(&cands, 8192, "g").unwrap(), 2);
        assert_eq!(select_algorithm(&cands, 1 << 20, "g").unwrap(), 0);
        assert_eq!(select_algorithm(&cands, 0, "g").unwrap(), 3);
    }

    #[test]
    fn algorithms_needing_more_than_the_plan_grants_are_refused_before_capture() {
        // What a library that ignores the max-workspace preference would return.
        let cands = [c(32 << 20, true), c(4 << 20, true), c(0, false)];
        let e = select_algorithm(
            &cands,
            1 << 20,
            "matmul x bf16[8,576] @ w bf16[1536,576]^T -> bf16[8,1536]",
        )
        .unwrap_err();
        match &e {
            BackendError::WorkspaceTooSmall {
                what,
                needed,
                granted,
            } => {
                assert!(what.contains("bf16[1536,576]"));
                assert_eq!((*needed, *granted), (4 << 20, 1 << 20));
            }
            other => panic!("expected WorkspaceTooSmall, got {other:?}"),
        }
        assert!(e.to_string().contains("recompile the plan"), "{e}");
    }

    #[test]
    fn no_usable_algorithm_is_a_device_error_naming_the_gemm() {
        for cands in [vec![], vec![c(0, false)]] {
            let e = select_algorithm(&cands, 1 << 20, "matmul X").unwrap_err();
            assert!(
                matches!(&e, BackendError::Device(m) if m.contains("matmul X") && m.contains("no algorithm")),
                "{e:?}"
            );
        }
    }

    #[test]
    fn the_workspace_grows_before_capture_and_never_moves_after() {
        let mut w = WorkspaceLedger::default();
        assert_eq!(w.plan(0).unwrap(), WorkspaceChange::Keep);
        assert_eq!(w.plan(4096).unwrap(), WorkspaceChange::Allocate(4096));
        w.commit(4096);
        assert_eq!(w.granted(), 4096);
        assert_eq!(w.plan(4096).unwrap(), WorkspaceChange::Keep);
        assert_eq!(
            w.plan(8192).unwrap(),
            WorkspaceChange::Reallocate {
                from: 4096,
                to: 8192
            }
        );
        assert_eq!(w.plan(0).unwrap(), WorkspaceChange::Release(4096));
        let key = Key::new(8, 1, 0);
        w.freeze(key);
        w.freeze(Key::new(1, 1, 0));
        assert_eq!(w.frozen_by(), Some(key));
        assert_eq!(w.plan(4096).unwrap(), WorkspaceChange::Keep);
        for bytes in [0, 1, 8192] {
            let e = w.plan(bytes).unwrap_err().to_string();
            assert!(
                e.contains("b8q1s0") && e.contains("before the first capture"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_gemm_workspace_must_lie_inside_the_reservation() {
        let w = WorkspaceLedger::default();
        let res = Some((DevPtr(0x10000), 4096));
        assert_eq!(w.grant_for(None, res, "g").unwrap(), (None, 0));
        assert_eq!(
            w.grant_for(Some((DevPtr(0x10000), 0)), None, "g").unwrap(),
            (None, 0)
        );
        assert_eq!(
            w.grant_for(Some((DevPtr(0x10000), 4096)), res, "g")
                .unwrap(),
            (Some(DevPtr(0x10000)), 4096)
        );
        assert_eq!(
            w.grant_for(Some((DevPtr(0x10800), 2048)), res, "g")
                .unwrap(),
            (Some(DevPtr(0x10800)), 2048)
        );
        for bad in [
            (DevPtr(0x10000), 4097),
            (DevPtr(0xff00), 16),
            (DevPtr(0x10f00), 512),
        ] {
            let e = w.grant_for(Some(bad), res, "g").unwrap_err().to_string();
            assert!(e.contains("outside the reserved BLAS workspace"), "{e}");
        }
        let e = w
            .grant_for(Some((DevPtr(0x10000), 16)), None, "g")
            .unwrap_err()
            .to_string();
        assert!(e.contains("none reserved"), "{e}");
    }
}
