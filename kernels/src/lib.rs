//! kiln kernels.
