//! Starting the engine behind the API: the scheduler task, the decode threads and the
//! engine thread with its ranks. `layerwise serve` and the in-process tests both start
//! here.

use std::sync::Arc;

use super::actor;
use super::decoders;
use super::ids::JobIds;
use super::scheduler::{DecodeJob, Retention, Scheduler};
use crate::decode::DecodeSite;
use crate::engine::Model;
use crate::execution::rank::EngineOptions;
use crate::{Error, Result};

/// A started engine: the scheduler's handle and the engine thread's outcome.
pub struct Engine {
    pub scheduler: Scheduler,
    pub done: tokio::sync::oneshot::Receiver<Result<()>>,
}

/// Starts the scheduler task (on the current tokio runtime), the decode threads and the
/// engine thread with its ranks. The server and the in-process tests both start here.
/// With `decode` on the device, each rank's device gets its decoder now, before the ranks
/// measure what memory is left them; a decoder that does not load fails the start.
pub fn start(
    model: Arc<Model>,
    opts: EngineOptions,
    decode: DecodeSite,
    max_queue: usize,
    retention: Retention,
    ids: JobIds,
) -> Result<Engine> {
    let decoders = decoders::on_devices(&model, &opts, decode)?;
    // Admission keeps at most max_queue + dp outputs past the queue (see the actor's
    // `submit`), so the decoders' channel always has room for what a rank finishes.
    let (decode_tx, decode_rx) = std::sync::mpsc::sync_channel::<DecodeJob>(max_queue + opts.dp);
    let (scheduler, source) = actor::start(opts.dp, max_queue, retention, ids, decode_tx);
    decoders::spawn(
        decoders,
        model.clone(),
        opts.decode_budget,
        &scheduler,
        decode_rx,
    )?;
    let (engine_tx, done) = tokio::sync::oneshot::channel::<Result<()>>();
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let r = model.drive(&opts, &source).map(drop);
            let _ = engine_tx.send(r);
        })
        .map_err(|e| Error::internal("cannot start the engine thread", e))?;
    Ok(Engine { scheduler, done })
}
