//! How the three binaries (the engine, the operator, the agent) write their logs: one
//! `--log-format` flag (`LAYERWISE_LOG_FORMAT`), `text` for a person at a terminal and
//! `json` for a log pipeline (one object a line, with the timestamp, level, target and
//! message, the event's fields beside them, and the spans it ran in with their fields),
//! the level filter from `LAYERWISE_LOG`, on stderr (stdout stays the commands' output).
//! It lives here, beside the HTTP layer the operator and the agent already share with the
//! engine, so the three cannot drift; the JSON is written by serde_json (no other
//! dependency).

use std::fmt;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::{SubscriberInitExt, TryInitError};
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Lines for a person to read.
    #[default]
    Text,
    /// One JSON object a line, for a log pipeline.
    Json,
}

/// The environment variable of `--log-format`, which the operator sets in the engine pods.
pub const ENV_LOG_FORMAT: &str = "LAYERWISE_LOG_FORMAT";

/// The logging flags every binary takes.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LogArgs {
    /// How log lines are written: `text`, or `json` (one object a line: timestamp, level,
    /// target, message, the event's fields and its spans) for a log pipeline. Levels come
    /// from `LAYERWISE_LOG` (e.g. `info,layerwise_engine=debug`).
    #[arg(
        long,
        env = ENV_LOG_FORMAT,
        value_enum,
        default_value_t = LogFormat::Text,
        global = true
    )]
    pub log_format: LogFormat,
}

/// A subscriber writing `format` to `writer`, filtered by `LAYERWISE_LOG` or else by
/// `default_filter` (e.g. `"info"`).
pub fn subscriber<W>(
    format: LogFormat,
    default_filter: &str,
    writer: W,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = EnvFilter::try_from_env("LAYERWISE_LOG").unwrap_or_else(|_| default_filter.into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LogFormat::Text => Box::new(builder.finish()),
        LogFormat::Json => Box::new(
            builder
                .fmt_fields(JsonFields)
                .event_format(JsonEvent)
                .finish(),
        ),
    }
}

/// Sets the process's subscriber (to stderr); an error when one is set already.
pub fn init(format: LogFormat, default_filter: &str) -> Result<(), TryInitError> {
    subscriber(format, default_filter, std::io::stderr).try_init()
}

/// Fields as a JSON object: the event's, and each span's (kept in the span as its text).
pub struct JsonFields;

impl<'w> FormatFields<'w> for JsonFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        mut writer: Writer<'w>,
        fields: R,
    ) -> fmt::Result {
        let mut map = Map::new();
        fields.record(&mut JsonVisitor(&mut map));
        write!(writer, "{}", Value::Object(map))
    }

    fn add_fields(
        &self,
        current: &mut FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> fmt::Result {
        let mut map = match serde_json::from_str(&current.fields) {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        };
        fields.record(&mut JsonVisitor(&mut map));
        current.fields = Value::Object(map).to_string();
        Ok(())
    }
}

/// One event as one line of JSON.
pub struct JsonEvent;

impl<S, N> FormatEvent<S, N> for JsonEvent
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut line = Map::new();
        event.record(&mut JsonVisitor(&mut line));
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        let meta = event.metadata();
        line.insert("timestamp".into(), timestamp.into());
        line.insert("level".into(), meta.level().as_str().into());
        line.insert("target".into(), meta.target().into());
        let spans: Vec<Value> = ctx
            .event_scope()
            .into_iter()
            .flat_map(|scope| scope.from_root())
            .map(|span| {
                let mut fields = span
                    .extensions()
                    .get::<FormattedFields<N>>()
                    .and_then(|f| serde_json::from_str::<Map<String, Value>>(&f.fields).ok())
                    .unwrap_or_default();
                fields.insert("name".into(), span.name().into());
                Value::Object(fields)
            })
            .collect();
        if !spans.is_empty() {
            line.insert("spans".into(), spans.into());
        }
        writeln!(writer, "{}", Value::Object(line))
    }
}

/// Records fields into a JSON object, numbers and booleans as themselves.
struct JsonVisitor<'a>(&'a mut Map<String, Value>);

impl Visit for JsonVisitor<'_> {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(field.name().into(), value.to_string().into());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl Write for Buffer {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> MakeWriter<'w> for Buffer {
        type Writer = Buffer;
        fn make_writer(&'w self) -> Buffer {
            self.clone()
        }
    }

    fn logged(format: LogFormat) -> String {
        let buffer = Buffer::default();
        let sub = subscriber(format, "info", buffer.clone());
        tracing::subscriber::with_default(sub, || {
            let span = tracing::info_span!("request", job = "j-1", n = 2);
            let _in = span.enter();
            span.record("n", 3);
            tracing::info!(user = "u \"q\"", steps = 4u64, ok = true, "job queued");
            tracing::debug!("filtered out");
        });
        let out = buffer.0.lock().unwrap().clone();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn json_lines_carry_the_event_and_its_spans() {
        let out = logged(LogFormat::Json);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 1, "{out}");
        let v: Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(v["message"], "job queued");
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["target"], module_path!());
        assert_eq!(v["user"], "u \"q\"");
        assert_eq!(
            (v["steps"].as_u64(), v["ok"].as_bool()),
            (Some(4), Some(true))
        );
        assert_eq!(v["spans"][0]["name"], "request");
        assert_eq!(v["spans"][0]["job"], "j-1");
        assert_eq!(v["spans"][0]["n"], 3, "a field recorded later replaces it");
        let ts = v["timestamp"].as_str().unwrap();
        assert!(ts.len() > 19 && ts.as_bytes()[10] == b'T', "{ts}");
    }

    #[test]
    fn text_stays_the_default() {
        let out = logged(LogFormat::default());
        assert!(out.contains("job queued"), "{out}");
        assert!(serde_json::from_str::<Value>(out.trim()).is_err(), "{out}");
    }

    #[test]
    fn the_flag_and_its_variable_choose_the_format() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            log: LogArgs,
        }
        let parse = |args: &[&str]| Cli::try_parse_from(args).map(|c| c.log.log_format);
        assert_eq!(
            parse(&["x", "--log-format", "json"]).unwrap(),
            LogFormat::Json
        );
        let e = parse(&["x", "--log-format", "yaml"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--log-format") && e.contains("json"), "{e}");
    }
}
