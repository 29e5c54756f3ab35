//! Headless Chromium driven over the DevTools protocol, as a person's browser: it trusts the
//! cluster's CA the way a user does (imported into the NSS database of its own `$HOME`
//! with `certutil`), types into forms, follows the redirects, keeps the cookies.
//!
//! The protocol runs over `--remote-debugging-pipe` (JSON messages ended by a NUL byte on
//! the browser's fd 3 and 4), here two FIFOs that `bash` opens for it: no port, no
//! WebSocket. One page target, attached in flat mode; every wait is for an event or an
//! answer, bounded by `STEP`.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::pipe;

/// How long one step (an answer, a page load) may take.
const STEP: Duration = Duration::from_secs(30);

/// The headless Chromium binary (`chromium-headless-shell` or `chromium`), or an error
/// saying what to install.
pub fn chromium() -> anyhow::Result<PathBuf> {
    for name in ["chromium-headless-shell", "chromium"] {
        for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
            let path = dir.join(name);
            if path.is_file() {
                return Ok(path);
            }
        }
    }
    bail!(
        "headless Chromium is not installed: `apt-get install -y chromium-headless-shell` \
         (scripts/test.sh installs it)"
    )
}

/// A browser with a profile and a `$HOME` of its own (removed when dropped, the process
/// killed).
pub struct Browser {
    child: tokio::process::Child,
    to: pipe::Sender,
    from: BufReader<pipe::Receiver>,
    next: u64,
    session: String,
    /// Events read while waiting for an answer, oldest first.
    events: VecDeque<Value>,
    dir: PathBuf,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Browser {
    /// Starts a browser whose NSS database trusts `ca` (PEM) for web sites, as a user who
    /// imported the cluster's CA once (`certutil -A -t C,,`); `None`: trusts nothing more.
    pub async fn launch(ca: Option<&Path>) -> anyhow::Result<Self> {
        let chromium = chromium()?;
        let dir = std::env::temp_dir().join(format!(
            "cairn-browser-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let nssdb = dir.join("home/.pki/nssdb");
        std::fs::create_dir_all(&nssdb)?;
        if let Some(ca) = ca {
            let db = format!("sql:{}", nssdb.display());
            let certutil = |args: &[&str]| -> anyhow::Result<()> {
                let out = std::process::Command::new("certutil")
                    .args(args)
                    .output()
                    .context("certutil (apt-get install libnss3-tools; scripts/test.sh does)")?;
                anyhow::ensure!(
                    out.status.success(),
                    "certutil {args:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                Ok(())
            };
            certutil(&["-N", "-d", &db, "--empty-password"])?;
            let ca = ca.to_str().context("the CA's path is not UTF-8")?;
            certutil(&[
                "-A",
                "-d",
                &db,
                "-n",
                "cairn cluster CA",
                "-t",
                "C,,",
                "-i",
                ca,
            ])?;
        }
        let (to_browser, from_browser) = (dir.join("cdp-in"), dir.join("cdp-out"));
        for fifo in [&to_browser, &from_browser] {
            let status = std::process::Command::new("mkfifo").arg(fifo).status()?;
            anyhow::ensure!(status.success(), "mkfifo {}", fifo.display());
        }
        // Read-write ends of our own: neither open waits for the browser's.
        let to = pipe::OpenOptions::new()
            .read_write(true)
            .open_sender(&to_browser)?;
        let from = pipe::OpenOptions::new()
            .read_write(true)
            .open_receiver(&from_browser)?;
        let script = r#"exec "$0" --headless --no-sandbox --disable-gpu --hide-scrollbars \
            --window-size=1280,1200 --user-data-dir="$1" --remote-debugging-pipe \
            about:blank 3<"$2" 4>"$3""#;
        let child = tokio::process::Command::new("bash")
            .arg("-c")
            .arg(script)
            .arg(&chromium)
            .arg(dir.join("profile"))
            .arg(&to_browser)
            .arg(&from_browser)
            .env("HOME", dir.join("home"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting chromium")?;
        let mut browser = Self {
            child,
            to,
            from: BufReader::new(from),
            next: 0,
            session: String::new(),
            events: VecDeque::new(),
            dir,
        };
        let target = browser
            .call(None, "Target.createTarget", json!({ "url": "about:blank" }))
            .await?;
        let target = target["targetId"]
            .as_str()
            .context("Target.createTarget gave no targetId")?
            .to_owned();
        let attached = browser
            .call(
                None,
                "Target.attachToTarget",
                json!({ "targetId": target, "flatten": true }),
            )
            .await?;
        browser.session = attached["sessionId"]
            .as_str()
            .context("Target.attachToTarget gave no sessionId")?
            .to_owned();
        browser.page("Page.enable", json!({})).await?;
        browser.page("Runtime.enable", json!({})).await?;
        Ok(browser)
    }

    /// One call (to the browser, or to the page's `session`); its result.
    async fn call(
        &mut self,
        session: Option<&str>,
        method: &str,
        params: Value,
    ) -> anyhow::Result<Value> {
        self.next += 1;
        let id = self.next;
        let mut message = json!({ "id": id, "method": method, "params": params });
        if let Some(session) = session {
            message["sessionId"] = json!(session);
        }
        let mut bytes = serde_json::to_vec(&message)?;
        bytes.push(0);
        self.to.write_all(&bytes).await?;
        loop {
            let message = self.read().await.with_context(|| method.to_owned())?;
            if message["id"].as_u64() == Some(id) {
                if let Some(error) = message.get("error") {
                    bail!("{method}: {error}");
                }
                return Ok(message["result"].clone());
            }
            if message.get("method").is_some() {
                self.events.push_back(message);
            }
        }
    }

    /// The next message from the browser.
    async fn read(&mut self) -> anyhow::Result<Value> {
        let mut buf = Vec::new();
        let n = tokio::time::timeout(STEP, self.from.read_until(0, &mut buf))
            .await
            .context("the browser did not answer within 30 s")??;
        anyhow::ensure!(
            n > 0 && buf.last() == Some(&0),
            "the browser closed its pipe"
        );
        buf.pop();
        Ok(serde_json::from_slice(&buf)?)
    }

    /// A call to the page.
    async fn page(&mut self, method: &str, params: Value) -> anyhow::Result<Value> {
        let session = self.session.clone();
        self.call(Some(&session), method, params).await
    }

    /// Waits for the page's next `load` event (one already read counts).
    async fn loaded(&mut self) -> anyhow::Result<()> {
        loop {
            while let Some(event) = self.events.pop_front() {
                if event["method"] == "Page.loadEventFired" {
                    return Ok(());
                }
            }
            let message = self.read().await.context("waiting for the page to load")?;
            if message["method"] == "Page.loadEventFired" {
                return Ok(());
            }
        }
    }

    /// Opens `url` and waits until it loaded; the error says why a load failed (a
    /// certificate the browser does not trust, say).
    pub async fn open(&mut self, url: &str) -> anyhow::Result<()> {
        self.events.clear();
        let navigated = self.page("Page.navigate", json!({ "url": url })).await?;
        if let Some(error) = navigated["errorText"].as_str() {
            bail!("{url}: {error}");
        }
        self.loaded().await
    }

    /// Evaluates `expression` in the page; its value (JSON).
    pub async fn eval(&mut self, expression: &str) -> anyhow::Result<Value> {
        let result = self
            .page(
                "Runtime.evaluate",
                json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
            )
            .await?;
        if let Some(exception) = result.get("exceptionDetails") {
            bail!("{expression}: {exception}");
        }
        Ok(result["result"]["value"].clone())
    }

    /// Evaluates `expression` (which makes the page go elsewhere: a form submitted) and
    /// waits for the next page to load.
    pub async fn eval_and_load(&mut self, expression: &str) -> anyhow::Result<()> {
        self.events.clear();
        self.eval(expression).await?;
        self.loaded().await
    }

    /// The page's URL path and its text.
    pub async fn page_text(&mut self) -> anyhow::Result<(String, String)> {
        let value = self
            .eval("JSON.stringify([location.pathname, document.body.innerText])")
            .await?;
        let (path, text): (String, String) =
            serde_json::from_str(value.as_str().context("not a string")?)?;
        Ok((path, text))
    }

    /// The page's HTML.
    pub async fn html(&mut self) -> anyhow::Result<String> {
        Ok(self
            .eval("document.documentElement.outerHTML")
            .await?
            .as_str()
            .unwrap_or_default()
            .to_owned())
    }

    /// A PNG of the page as it shows now (1280 wide), written to `path`.
    pub async fn screenshot(&mut self, path: &Path) -> anyhow::Result<()> {
        let shot = self
            .page(
                "Page.captureScreenshot",
                json!({ "format": "png", "captureBeyondViewport": true }),
            )
            .await?;
        let data = shot["data"].as_str().context("no screenshot data")?;
        let png = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, data)?;
        std::fs::write(path, png)?;
        Ok(())
    }
}
