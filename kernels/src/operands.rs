//! The one check every kernel makes before it touches memory: each operand's length is
//! what the call's shape makes it. A module of its own because both the elementwise
//! kernels (the crate root) and [`crate::linear`] make it, and the linear layer's file
//! should not reach back into the root that declares it.

/// Panics, naming both lengths, at the first `(have, want)` pair that differ.
pub(crate) fn check(lengths: &[(usize, usize)]) {
    for &(have, want) in lengths {
        assert_eq!(
            have, want,
            "a kernel's operand of {have} elements where its shape makes {want}"
        );
    }
}
