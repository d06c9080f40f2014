//! Why a pod cannot run: the kubelet's reason and a message, and the macro that refuses
//! what the runner cannot honour.

/// Why a pod cannot run: the kubelet's reason for it and a message.
#[derive(Debug)]
pub(super) struct Refusal {
    pub(super) reason: &'static str,
    pub(super) message: String,
}

impl Refusal {
    pub(super) fn config(message: impl Into<String>) -> Refusal {
        Refusal {
            reason: "CreateContainerConfigError",
            message: message.into(),
        }
    }
}

impl From<anyhow::Error> for Refusal {
    fn from(e: anyhow::Error) -> Refusal {
        Refusal::config(format!("{e:#}"))
    }
}

/// Fails with a [`Refusal::config`] unless `cond`.
macro_rules! refuse_unless {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(Refusal::config(format!($($msg)+)));
        }
    };
}
pub(super) use refuse_unless;
