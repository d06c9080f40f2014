//! The small dense solve UniPC's higher orders need (`torch.linalg.solve` in float32): LU
//! with partial pivoting that scales by the pivots' reciprocals both in the factorisation
//! (as LAPACK's `sgetrf2`) and in the back substitution (as MKL's triangular solve, which
//! torch's CPU build calls: dividing instead rounds UniPC's 2×2 corrector coefficients an ulp
//! away from torch's in most steps).

/// Solves `a · x = b` for a square `a` (rows), in f32.
pub(super) fn solve(mut a: Vec<Vec<f32>>, mut b: Vec<f32>) -> Vec<f32> {
    let n = b.len();
    debug_assert!(a.len() == n && a.iter().all(|r| r.len() == n));
    for k in 0..n {
        // The first row with the largest magnitude, as isamax picks it.
        let mut p = k;
        for i in k + 1..n {
            if a[i][k].abs() > a[p][k].abs() {
                p = i;
            }
        }
        a.swap(k, p);
        b.swap(k, p);
        let r = 1.0 / a[k][k];
        let (done, rest) = a.split_at_mut(k + 1);
        let pivot = &done[k];
        for (i, row) in rest.iter_mut().enumerate() {
            let l = row[k] * r;
            row[k] = l;
            for (x, p) in row[k + 1..].iter_mut().zip(&pivot[k + 1..]) {
                *x -= l * p;
            }
            b[k + 1 + i] -= l * b[k];
        }
    }
    for k in (0..n).rev() {
        b[k] *= 1.0 / a[k][k];
        for i in 0..k {
            b[i] -= b[k] * a[i][k];
        }
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solves_with_pivoting() {
        // Needs a row swap: the first pivot is 0.
        let x = solve(vec![vec![0.0, 2.0], vec![4.0, 1.0]], vec![2.0, 9.0]);
        assert_eq!(x, vec![2.0, 1.0]);
        let a = vec![
            vec![1.0, 1.0, 1.0],
            vec![-1.5, -0.5, 1.0],
            vec![2.25, 0.25, 1.0],
        ];
        let x = solve(a.clone(), vec![6.0, 1.0, 4.0]);
        for (row, want) in a.iter().zip([6.0, 1.0, 4.0]) {
            let got: f32 = row.iter().zip(&x).map(|(a, x)| a * x).sum();
            assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        }
    }
}
