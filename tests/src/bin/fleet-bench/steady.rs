//! After planning: API requests per reconcile in the steady state, and a restart (the
//! time a new operator takes to lead and reconcile every deployment once).

use std::time::{Duration, Instant};

use anyhow::Result;

use super::args::Args;
use super::operator::{Metrics, Operator, Window};
use super::planning::print_memory;

/// The steady state: every deployment looked at every resync period.
pub(super) struct Steady {
    pub(super) requests: Window,
    /// The operator's VmRSS and VmHWM at its end.
    pub(super) memory: (u64, u64),
}

impl Steady {
    /// Lets a resync period pass, then measures `--steady-seconds` of it.
    pub(super) async fn measure(a: &Args, op: &Operator) -> Result<Steady> {
        tokio::time::sleep(Duration::from_secs(a.resync_seconds)).await;
        let s0 = op.metrics().await?;
        tokio::time::sleep(Duration::from_secs(a.steady_seconds)).await;
        let s1 = op.metrics().await?;
        let steady = Window::between(&s0, &s1);
        steady.print("steady");
        let mem_steady = op.memory()?;
        print_memory(mem_steady);
        Ok(Steady {
            requests: steady,
            memory: mem_steady,
        })
    }
}

/// A restart: a new operator's time to lead and reconcile every deployment once.
pub(super) struct Restart {
    /// From the new process's start until every deployment was reconciled.
    pub(super) reconciled_all: Duration,
    /// Its requests in that first pass.
    pub(super) requests: Window,
    /// Its VmRSS and VmHWM then.
    pub(super) memory: (u64, u64),
}

impl Restart {
    /// SIGTERM to `op` (the lease is released), then a new process that leads and
    /// reconciles all, stopped once measured.
    pub(super) async fn measure(a: &Args, op: &mut Operator) -> Result<Restart> {
        op.stop().await?;
        let t = Instant::now();
        let mut op2 = Operator::start(a, "fleet-bench-operator-1").await?;
        let led2 = op2.wait_leading().await?;
        let restart = op2.wait_reconciled(a.deployments, t).await?;
        let cold = Window::between(&Metrics::default(), &restart.1);
        println!(
            "restart: leading {:.2} s after start, every deployment reconciled after {:.2} s",
            led2.as_secs_f64(),
            restart.0.as_secs_f64()
        );
        cold.print("first pass after a restart");
        let mem_restart = op2.memory()?;
        op2.stop().await?;
        Ok(Restart {
            reconciled_all: restart.0,
            requests: cold,
            memory: mem_restart,
        })
    }
}
