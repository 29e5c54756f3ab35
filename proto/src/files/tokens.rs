//! A tokens file (`--auth-tokens`): one `ROLE SHA256HEX [NAME]` a line, the SHA-256 of each
//! bearer token the daemons accept and the role it grants. Only hashes are stored: the file
//! admits tokens without holding them.

use sha2::{Digest, Sha256};

/// What a token allows, from least to most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Reads: get, list and watch snapshots and restores, nodes, the policy.
    Viewer,
    /// A viewer that also starts and aborts snapshots and sets the policy.
    Operator,
    /// An operator that also deletes snapshots, restores, and drives a daemon's NodeAdmin.
    Admin,
}

impl Role {
    /// Its name in the tokens file and in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "viewer" => Ok(Role::Viewer),
            "operator" => Ok(Role::Operator),
            "admin" => Ok(Role::Admin),
            other => Err(format!(
                "unknown role {other:?} (viewer, operator or admin)"
            )),
        }
    }
}

/// One token of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenEntry {
    /// Its role.
    pub role: Role,
    /// The SHA-256 of the token.
    pub hash: [u8; 32],
    /// Its name, if the line gives one (for logs).
    pub name: Option<String>,
}

/// The tokens a file holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tokens {
    entries: Vec<TokenEntry>,
}

impl Tokens {
    /// Parses a tokens file: one `ROLE SHA256HEX [NAME]` a line, `#` starts a comment,
    /// blank lines are skipped. The error names the line (from 1) and what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut entries: Vec<TokenEntry> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let n = i + 1;
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some(role), Some(hash)) = (words.next(), words.next()) else {
                return Err(format!(
                    "line {n}: expected ROLE SHA256HEX [NAME], got {line:?}"
                ));
            };
            let role: Role = role.parse().map_err(|e| format!("line {n}: {e}"))?;
            let hash = parse_hash(hash).ok_or_else(|| {
                format!("line {n}: {hash:?} is not a SHA-256 in hex (64 hex digits)")
            })?;
            let rest: Vec<&str> = words.collect();
            let name = (!rest.is_empty()).then(|| rest.join(" "));
            if entries.iter().any(|e| e.hash == hash) {
                return Err(format!("line {n}: this token's hash is already listed"));
            }
            entries.push(TokenEntry { role, hash, name });
        }
        Ok(Self { entries })
    }

    /// The tokens.
    pub fn entries(&self) -> &[TokenEntry] {
        &self.entries
    }

    /// The entry of `token`, comparing its SHA-256 with every entry in constant time.
    pub fn find(&self, token: &str) -> Option<&TokenEntry> {
        self.find_hash(&Sha256::digest(token.as_bytes()).into())
    }

    /// The entry whose token has SHA-256 `hash`, compared in constant time (a console
    /// session names its token by hash).
    pub fn find_hash(&self, hash: &[u8; 32]) -> Option<&TokenEntry> {
        let mut found = None;
        for entry in &self.entries {
            if constant_time_eq(&entry.hash, hash) {
                found = Some(entry);
            }
        }
        found
    }
}

fn parse_hash(text: &str) -> Option<[u8; 32]> {
    let bytes = hex::decode(text).ok()?;
    bytes.try_into().ok()
}

/// Equal, in a time that depends only on the length.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
