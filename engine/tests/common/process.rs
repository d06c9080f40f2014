//! The real `layerwise serve` process on 127.0.0.1, killed when dropped.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use layerwise_engine::tools::loadgen::{http, HttpResponse};
use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_layerwise");
/// How long a server may take to answer or to start.
pub const T: Duration = Duration::from_secs(120);

pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `layerwise serve --model MODEL ARGS` on a free port and reads the address it
/// prints.
pub fn spawn(model: &Path, args: &[&str]) -> Server {
    spawn_with(model, "127.0.0.1:0", args, &[])
}

/// [`spawn`] listening on `listen`, with `env` set beside the test's own environment.
pub fn spawn_with(model: &Path, listen: &str, args: &[&str], env: &[(&str, &str)]) -> Server {
    let mut child = Command::new(BIN)
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--listen", listen])
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = rx.recv_timeout(T).expect("server printed its address");
    let addr = line
        .strip_prefix("listening on http://")
        .expect(&line)
        .parse()
        .unwrap();
    Server { child, addr }
}

impl Server {
    pub async fn call(&self, method: &str, path: &str, body: Option<Value>) -> HttpResponse {
        let b = body.map(|b| b.to_string().into_bytes());
        http(self.addr, method, path, b.as_deref(), T)
            .await
            .unwrap()
    }

    pub async fn wait_ready(&self) {
        let deadline = Instant::now() + T;
        while self.call("GET", "/readyz", None).await.status != 200 {
            assert!(Instant::now() < deadline, "never ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}
