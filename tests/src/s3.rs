//! A real S3-compatible server for tests: SeaweedFS's `weed server -s3` (built by
//! `tests/tools/build-seaweedfs` from the Go module proxy, cached), on loopback ports only,
//! with its data in a temporary folder and one identity whose keys the tests hold. Killed
//! when dropped.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use crate::tools::repo;

/// The access key of the server's one identity.
pub const ACCESS_KEY: &str = "layerwise-test";
/// Its secret key.
pub const SECRET_KEY: &str = "layerwise-test-secret-key";

/// The `weed` binary (built by `tests/tools/build-seaweedfs`, a no-op when cached).
pub fn weed() -> Result<PathBuf> {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    if let Some(b) = BIN.get() {
        return Ok(b.clone());
    }
    let out = Command::new(repo().join("tests/tools/build-seaweedfs"))
        .stderr(Stdio::inherit())
        .output()?;
    ensure!(out.status.success(), "tests/tools/build-seaweedfs failed");
    let line = String::from_utf8(out.stdout)?
        .lines()
        .last()
        .context("tests/tools/build-seaweedfs printed nothing")?
        .trim()
        .to_string();
    Ok(BIN.get_or_init(|| PathBuf::from(line)).clone())
}

/// A running SeaweedFS with its S3 gateway.
pub struct S3Server {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
    /// The master's and the filer's addresses as `weed shell` takes them (`host:http.grpc`:
    /// their gRPC ports are not the default offsets).
    master: String,
    filer: String,
    _data: tempfile::TempDir,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port free on loopback now.
fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl S3Server {
    /// Starts a server and waits until its S3 gateway answers.
    pub fn start() -> Result<S3Server> {
        let weed = weed()?;
        let data = tempfile::tempdir()?;
        let config = data.path().join("s3.json");
        std::fs::write(
            &config,
            serde_json::json!({ "identities": [{
                "name": "tests",
                "credentials": [{ "accessKey": ACCESS_KEY, "secretKey": SECRET_KEY }],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }] })
            .to_string(),
        )?;
        let mut ports = Vec::new();
        while ports.len() < 8 {
            let p = free_port()?;
            if !ports.contains(&p) {
                ports.push(p);
            }
        }
        let arg = |name: &str, i: usize| format!("-{name}={}", ports[i]);
        let log = std::fs::File::create(data.path().join("weed.log"))?;
        let child = Command::new(&weed)
            .arg("server")
            .arg(format!("-dir={}", data.path().display()))
            .args([
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-s3",
                "-volume.max=4",
            ])
            .args(["-master.volumeSizeLimitMB=64"])
            .arg(arg("master.port", 0))
            .arg(arg("master.port.grpc", 1))
            .arg(arg("volume.port", 2))
            .arg(arg("volume.port.grpc", 3))
            .arg(arg("filer.port", 4))
            .arg(arg("filer.port.grpc", 5))
            .arg(arg("s3.port", 6))
            .arg(arg("s3.port.grpc", 7))
            .arg(format!("-s3.config={}", config.display()))
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", weed.display()))?;
        let mut s = S3Server {
            child,
            endpoint: format!("http://127.0.0.1:{}", ports[6]),
            master: format!("127.0.0.1:{}.{}", ports[0], ports[1]),
            filer: format!("127.0.0.1:{}.{}", ports[4], ports[5]),
            _data: data,
        };
        let s3 = SocketAddr::from(([127, 0, 0, 1], ports[6]));
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect_timeout(&s3, Duration::from_millis(200)).is_err() {
            if let Some(status) = s.child.try_wait()? {
                bail!("weed exited with {status} before serving S3: {}", s.log());
            }
            ensure!(
                Instant::now() < deadline,
                "weed never served S3: {}",
                s.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(s)
    }

    /// The server's log so far, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._data.path().join("weed.log")).unwrap_or_default()
    }

    /// Creates bucket `name` (through `weed shell`, as an operator of the store would).
    pub fn create_bucket(&self, name: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = Command::new(weed()?)
                .arg("shell")
                .arg(format!("-master={}", self.master))
                .arg(format!("-filer={}", self.filer))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .and_then(|mut c| {
                    use std::io::Write;
                    let mut stdin = c.stdin.take().expect("piped");
                    writeln!(stdin, "s3.bucket.create -name {name}")?;
                    drop(stdin);
                    c.wait_with_output()
                })?;
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            if out.status.success() && !text.to_lowercase().contains("error") {
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "creating bucket {name}: {text}\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}
