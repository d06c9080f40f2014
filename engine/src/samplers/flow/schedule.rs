//! The sigma schedule arithmetic both flow schedulers share, in float64 as numpy computes
//! it in diffusers (`linspace`, the static shift, the stretch to a terminal value), and the
//! limits on a request's step count that keep the schedule finite.

use crate::{Error, Result};

/// `steps` within 1..=`num_train_timesteps`, and not one step with a terminal shift, whose
/// stretch divides 0 by 0 in diffusers.
pub(super) fn check_steps(
    steps: usize,
    num_train_timesteps: usize,
    terminal: Option<f64>,
) -> Result<()> {
    if steps == 0 || steps > num_train_timesteps {
        return Err(Error::invalid(
            "steps",
            format!("{steps}: must be between 1 and num_train_timesteps ({num_train_timesteps})"),
        ));
    }
    if steps == 1 && terminal.is_some() {
        return Err(Error::invalid(
            "steps",
            "1 step with the scheduler's shift_terminal: the stretch to the terminal value is \
             0/0 (diffusers samples NaN); use at least 2",
        ));
    }
    Ok(())
}

/// A schedule whose sigmas are all finite (guards the corner cases the checks above miss).
pub(super) fn check_finite(sigmas: &[f32], steps: usize) -> Result<()> {
    match sigmas.iter().find(|s| !s.is_finite()) {
        Some(s) => Err(Error::invalid(
            "steps",
            format!("the {steps}-step schedule has a non-finite sigma ({s})"),
        )),
        None => Ok(()),
    }
}

/// `shift_terminal` as diffusers tests it (`if config.shift_terminal:`): null and 0 are off.
pub(super) fn terminal(shift_terminal: Option<f64>) -> Option<f64> {
    shift_terminal.filter(|&t| t != 0.0)
}

/// `np.linspace(start, stop, num)` in float64: `i * step + start`, the last element `stop`.
pub(super) fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    if num <= 1 {
        return vec![start; num];
    }
    let div = (num - 1) as f64;
    let delta = stop - start;
    let step = delta / div;
    let mut y: Vec<f64> = (0..num)
        .map(|i| {
            // numpy divides first when the step underflows to zero.
            let v = if step == 0.0 {
                i as f64 / div * delta
            } else {
                i as f64 * step
            };
            v + start
        })
        .collect();
    y[num - 1] = stop;
    y
}

/// The static flow shift `shift·σ / (1 + (shift − 1)·σ)` in float64 (numpy).
pub(super) fn shift_sigmas(sigmas: &mut [f64], shift: f64) {
    for s in sigmas {
        *s = shift * *s / (1.0 + (shift - 1.0) * *s);
    }
}

/// diffusers' `stretch_shift_to_terminal` in float64: rescales `1 − σ` so the last sigma
/// lands on `terminal`.
pub(super) fn stretch_to_terminal(sigmas: &mut [f64], terminal: f64) {
    let Some(&last) = sigmas.last() else { return };
    let scale = (1.0 - last) / (1.0 - terminal);
    for s in sigmas {
        *s = 1.0 - ((1.0 - *s) / scale);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linspace_is_numpys() {
        // np.linspace(1, 0.001, 5) and np.linspace(1000.0, 2.994012087583542, 3).
        assert_eq!(
            linspace(1.0, 0.001, 5),
            vec![1.0, 0.75025, 0.5005, 0.25075000000000003, 0.001]
        );
        assert_eq!(
            linspace(1000.0, 2.994012087583542, 3),
            vec![1000.0, 501.49700604379177, 2.994012087583542]
        );
        assert_eq!(linspace(7.0, 1.0, 1), vec![7.0]);
    }

    #[test]
    fn terminal_stretch_ends_on_the_terminal_value() {
        let mut s = vec![0.9, 0.5, 0.2];
        stretch_to_terminal(&mut s, 0.1);
        // numpy: [0.8875000000000001, 0.4375, 0.09999999999999998].
        assert_eq!(s, vec![0.8875000000000001, 0.4375, 0.09999999999999998]);
        assert_eq!(terminal(Some(0.0)), None);
        assert_eq!(terminal(None), None);
    }
}
