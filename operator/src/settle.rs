//! Gathers a stream's repeated items into one, released when they settle, with a bound on
//! how long any item waits.
//!
//! Agents report a deployment's profiles node by node, within a second or so of each other,
//! and a change to a node concerns every deployment whose selector matches it. One reconcile
//! after a deployment's triggers settle plans on all of the reports at once, instead of
//! recording a plan per report. A plain debounce (release after `quiet` without a new
//! trigger) starves a deployment that matches a busy fleet: with triggers more often than
//! `quiet`, it is never released. So an item is released `quiet` after its last trigger, or
//! `longest` after its first, whichever comes first.

use std::collections::HashMap;
use std::hash::Hash;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::time::Instant;
use tokio_util::time::{delay_queue, DelayQueue};

/// The stream [`settle`] returns.
pub struct Settle<S: Stream> {
    input: Option<Pin<Box<S>>>,
    queue: DelayQueue<S::Item>,
    /// Each waiting item: its place in the queue and when its first trigger came.
    waiting: HashMap<S::Item, (delay_queue::Key, Instant)>,
    quiet: Duration,
    longest: Duration,
}

/// Releases each distinct item of `input` once `quiet` passes without it recurring, or once
/// `longest` has passed since it first came (whichever is sooner); the triggers it had
/// meanwhile are folded into that one release. Ends when `input` has ended and nothing waits.
pub fn settle<S>(input: S, quiet: Duration, longest: Duration) -> Settle<S>
where
    S: Stream,
    S::Item: Hash + Eq + Clone,
{
    Settle {
        input: Some(Box::pin(input)),
        queue: DelayQueue::new(),
        waiting: HashMap::new(),
        quiet,
        longest: longest.max(quiet),
    }
}

impl<S> Settle<S>
where
    S: Stream,
    S::Item: Hash + Eq + Clone,
{
    fn add(&mut self, item: S::Item) {
        let now = Instant::now();
        match self.waiting.get(&item) {
            Some(&(key, first)) => {
                let at = (now + self.quiet).min(first + self.longest);
                self.queue.reset_at(&key, at);
            }
            None => {
                let key = self.queue.insert_at(item.clone(), now + self.quiet);
                self.waiting.insert(item, (key, now));
            }
        }
    }
}

impl<S> Stream for Settle<S>
where
    S: Stream,
    S::Item: Hash + Eq + Clone + Unpin,
{
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let this = self.get_mut();
        while let Some(input) = this.input.as_mut() {
            match input.poll_next_unpin(cx) {
                Poll::Ready(Some(item)) => this.add(item),
                Poll::Ready(None) => this.input = None,
                Poll::Pending => break,
            }
        }
        match this.queue.poll_expired(cx) {
            Poll::Ready(Some(expired)) => {
                let item = expired.into_inner();
                this.waiting.remove(&item);
                Poll::Ready(Some(item))
            }
            // Nothing waits: done if the input is, else its waker brings the next item.
            Poll::Ready(None) if this.input.is_none() => Poll::Ready(None),
            Poll::Ready(None) | Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::stream;

    const QUIET: Duration = Duration::from_secs(1);
    const LONGEST: Duration = Duration::from_secs(3);

    /// Items at the given offsets (ms from the start), released by `settle`; each release
    /// with its offset (ms), under tokio's paused clock.
    async fn released(at: Vec<(u64, &'static str)>) -> Vec<(u64, &'static str)> {
        let start = Instant::now();
        let input = stream::iter(at).then(move |(ms, item)| async move {
            tokio::time::sleep_until(start + Duration::from_millis(ms)).await;
            item
        });
        settle(input, QUIET, LONGEST)
            .map(|item| (start.elapsed().as_millis() as u64, item))
            .collect()
            .await
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_is_released_once_when_it_settles() {
        let got = released(vec![(0, "a"), (300, "a"), (700, "a"), (1200, "a")]).await;
        assert_eq!(got, [(2200, "a")]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_item_that_keeps_recurring_is_released_within_the_longest_wait() {
        // Every 0.4 s for ten seconds: a debounce would hold it until the last one settled.
        let got = released((0..25).map(|i| (i * 400, "busy")).collect()).await;
        let times: Vec<u64> = got.iter().map(|(ms, _)| *ms).collect();
        assert_eq!(times, [3000, 6200, 9400, 10600]);
    }

    #[tokio::test(start_paused = true)]
    async fn items_wait_apart_from_each_other() {
        let got = released(vec![(0, "a"), (100, "b"), (500, "a"), (2000, "b")]).await;
        assert_eq!(got, [(1100, "b"), (1500, "a"), (3000, "b")]);
    }
}
