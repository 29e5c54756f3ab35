//! Where the blob store is: `file:///path` (a local directory) or `s3://bucket/prefix`
//! (S3-compatible object storage), and the flags both daemons share to say so.

use std::path::PathBuf;

/// A parsed `--blob-store` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A local directory.
    Dir(PathBuf),
    /// A bucket of an S3-compatible store, and a key prefix in it ("" for none).
    S3 {
        /// The bucket.
        bucket: String,
        /// Keys start with `<prefix>/` (no leading or trailing slash; empty for none).
        prefix: String,
    },
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Dir(dir) => write!(f, "file://{}", dir.display()),
            Location::S3 { bucket, prefix } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            Location::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
        }
    }
}

/// Why a `--blob-store` URL is not one.
#[derive(Debug, thiserror::Error)]
#[error("--blob-store `{url}`: {why} (expected file:///absolute/path or s3://bucket/prefix)")]
pub struct BadLocation {
    url: String,
    why: String,
}

impl std::str::FromStr for Location {
    type Err = BadLocation;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| BadLocation {
            url: url.chars().take(200).collect(),
            why: why.into(),
        };
        if url.len() > 1024 {
            return Err(bad("longer than 1024 bytes"));
        }
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(bad("a file:// location takes an absolute path"));
            }
            return Ok(Location::Dir(PathBuf::from(path)));
        }
        let Some(rest) = url.strip_prefix("s3://") else {
            return Err(bad("unknown scheme"));
        };
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        // S3's bucket naming rules.
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.'))
            && !bucket.starts_with(['-', '.'])
            && !bucket.ends_with(['-', '.']);
        if !bucket_ok {
            return Err(bad(
                "a bucket name is 3 to 63 lowercase letters, digits, dots and hyphens",
            ));
        }
        let prefix = prefix.trim_end_matches('/');
        let segments_ok = prefix.is_empty()
            || prefix.split('/').all(|s| {
                !s.is_empty()
                    && s != "."
                    && s != ".."
                    && s.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            });
        if !segments_ok {
            return Err(bad(
                "a prefix is /-separated segments of letters, digits, '-', '_' and '.'",
            ));
        }
        Ok(Location::S3 {
            bucket: bucket.into(),
            prefix: prefix.into(),
        })
    }
}

/// The blob store flags of `cairn-coordinator` and `cairn-node`. Credentials come from the
/// usual `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`) variables.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct BlobArgs {
    /// Where snapshot data is kept: file:///absolute/path (a local directory) or
    /// s3://bucket/prefix (S3-compatible object storage; credentials from AWS_ACCESS_KEY_ID
    /// and AWS_SECRET_ACCESS_KEY). For cairn-node: the coordinator's store, which the daemon
    /// then writes its new state chunks to itself instead of sending them to the
    /// coordinator.
    #[arg(long = "blob-store", env = "CAIRN_BLOB_STORE", value_name = "URL")]
    pub blob_store: Option<Location>,
    /// The S3 endpoint, e.g. http://127.0.0.1:8333 for a local server (default: AWS's, from
    /// the region).
    #[arg(long = "s3-endpoint", env = "AWS_ENDPOINT_URL", value_name = "URL")]
    pub s3_endpoint: Option<String>,
    /// Allow a plain-HTTP S3 endpoint (local test servers only: credentials and data travel
    /// in the clear).
    #[arg(long = "s3-allow-http")]
    pub s3_allow_http: bool,
    /// The S3 region.
    #[arg(
        long = "s3-region",
        env = "AWS_REGION",
        default_value = "us-east-1",
        value_name = "REGION"
    )]
    pub s3_region: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse_and_bad_ones_say_why() {
        assert_eq!(
            "file:///var/lib/cairn/blobs".parse::<Location>().unwrap(),
            Location::Dir("/var/lib/cairn/blobs".into())
        );
        assert_eq!(
            "s3://cairn-data/prod/eu/".parse::<Location>().unwrap(),
            Location::S3 {
                bucket: "cairn-data".into(),
                prefix: "prod/eu".into()
            }
        );
        assert_eq!(
            "s3://cairn".parse::<Location>().unwrap().to_string(),
            "s3://cairn"
        );
        for (url, why) in [
            ("file://relative", "absolute"),
            ("gs://b/p", "unknown scheme"),
            ("s3://B/p", "bucket"),
            ("s3://ab/p", "bucket"),
            ("s3://bucket/a/../b", "prefix"),
            ("s3://bucket//a", "prefix"),
        ] {
            let e = url.parse::<Location>().unwrap_err().to_string();
            assert!(e.contains(why), "{url}: {e}");
        }
    }
}
