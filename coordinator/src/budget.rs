//! The process-wide budget for what responses hold in memory: inline snapshot data
//! (`GetSnapshot` with `include_data`) and snapshot diffs, on every replica. A response
//! reserves its bytes before it reads them and gives them back when it is built; past the
//! budget the call is refused at once with RESOURCE_EXHAUSTED naming the streaming read,
//! instead of the process growing with every concurrent call.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::Error;

/// The budget's unit: reservations are rounded up to whole KiB.
const UNIT: u64 = 1024;

/// The default budget (`--response-memory-mib`).
pub(crate) const DEFAULT_MIB: u64 = 256;

/// Bytes responses may hold in memory at once.
#[derive(Clone)]
pub(crate) struct ResponseBudget {
    units: Arc<Semaphore>,
    total_units: u64,
}

/// Bytes reserved; given back when dropped.
pub(crate) struct Reserved(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

impl ResponseBudget {
    /// A budget of `bytes` (at least one unit).
    pub(crate) fn new(bytes: u64) -> Self {
        let total_units = (bytes / UNIT).clamp(1, u64::from(u32::MAX));
        Self {
            units: Arc::new(Semaphore::new(total_units as usize)),
            total_units,
        }
    }

    /// The budget in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.total_units * UNIT
    }

    /// Reserves `bytes` for `what` (e.g. "snapshot 7's inline data"), or refuses with
    /// RESOURCE_EXHAUSTED naming `ReadSnapshotData`, the streamed read, as the way.
    pub(crate) fn reserve(&self, bytes: u64, what: &str) -> Result<Reserved, Error> {
        let units = bytes.div_ceil(UNIT).max(1);
        let mib = |b: u64| b.div_ceil(1 << 20);
        if units > self.total_units {
            return Err(Error::TooMuchMemory(format!(
                "{what} needs {} MiB in memory, more than the {} MiB all responses may hold \
                 (--response-memory-mib): read it with ReadSnapshotData, which streams it \
                 (cairnctl snapshot export)",
                mib(bytes),
                mib(self.bytes())
            )));
        }
        let permit = u32::try_from(units)
            .ok()
            .and_then(|n| self.units.clone().try_acquire_many_owned(n).ok())
            .ok_or_else(|| {
                Error::TooMuchMemory(format!(
                    "{what} needs {} MiB in memory and other responses hold most of the {} MiB \
                     all may hold at once (--response-memory-mib): try again later, or read it \
                     with ReadSnapshotData, which streams it (cairnctl snapshot export)",
                    mib(bytes),
                    mib(self.bytes())
                ))
            })?;
        Ok(Reserved(Some(permit)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_bounded_and_given_back() {
        let budget = ResponseBudget::new(10 << 20);
        let a = budget.reserve(6 << 20, "a").unwrap();
        let refused = budget.reserve(6 << 20, "b").err().unwrap();
        assert!(
            refused.to_string().contains("ReadSnapshotData"),
            "{refused}"
        );
        assert_eq!(
            tonic::Status::from(refused).code(),
            tonic::Code::ResourceExhausted
        );
        let c = budget.reserve(4 << 20, "c").unwrap();
        drop(a);
        let _b = budget.reserve(6 << 20, "b").unwrap();
        drop(c);
        let whole = budget.reserve(11 << 20, "too big").err().unwrap();
        assert!(
            whole.to_string().contains("more than the 10 MiB"),
            "{whole}"
        );
        // Zero bytes still take a unit, and come back.
        let z = budget.reserve(0, "nothing").unwrap();
        drop(z);
    }
}
