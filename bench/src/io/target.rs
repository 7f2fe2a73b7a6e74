//! A started system of `tern bench io`: the one place that knows every kind of target and
//! passes each step of the run (prepare reads, measure a cell, finish reads, stop) to it.

use super::file::FileTarget;
use super::raw::{RawTarget, RawTransport};
use super::redis::RedisTarget;
use super::tern::TernTarget;
use super::{Cell, CellResult, IoOptions, System};

/// A prepared system: how to reach it, and its read set for the size being measured.
pub(super) struct Target {
    pub(super) system: System,
    kind: TargetKind,
}

enum TargetKind {
    Tern(Box<TernTarget>),
    Raw(RawTarget),
    Redis(RedisTarget),
    File(FileTarget),
}

impl Target {
    pub(super) async fn start(system: System, options: &IoOptions) -> anyhow::Result<Target> {
        let kind = match system {
            System::TernTcp
            | System::TernTls
            | System::TernQuic
            | System::TernNvme
            | System::TernLocal
            | System::TernRdma => TargetKind::Tern(Box::new(TernTarget::start(system, options).await?)),
            System::TcpRaw => TargetKind::Raw(RawTarget::start(RawTransport::Tcp).await?),
            System::TlsRaw => TargetKind::Raw(RawTarget::start(RawTransport::Tls).await?),
            System::QuicRaw => TargetKind::Raw(RawTarget::start(RawTransport::Quic).await?),
            System::Redis => TargetKind::Redis(RedisTarget::start().await?),
            System::File => TargetKind::File(FileTarget::start(&options.dir, false)?),
            System::FileDirect => TargetKind::File(FileTarget::start(&options.dir, true)?),
        };
        Ok(Target { system, kind })
    }

    pub(super) fn redis(&self) -> Option<&RedisTarget> {
        match &self.kind {
            TargetKind::Redis(redis) => Some(redis),
            _ => None,
        }
    }

    pub(super) fn describe(&self) -> Option<String> {
        match &self.kind {
            TargetKind::Tern(_) | TargetKind::Raw(_) => None,
            TargetKind::Redis(r) => Some(r.describe()),
            TargetKind::File(f) => Some(f.describe(self.system)),
        }
    }

    pub(super) async fn prepare_reads(&mut self, size: u64, items: u64) -> anyhow::Result<()> {
        match &mut self.kind {
            TargetKind::Tern(t) => t.prepare_reads(size, items).await,
            TargetKind::Raw(_) => Ok(()),
            TargetKind::Redis(r) => r.prepare_reads(size, items).await,
            TargetKind::File(f) => f.prepare_reads(size, items),
        }
    }

    pub(super) async fn finish_reads(&mut self, size: u64) -> anyhow::Result<Option<String>> {
        match &mut self.kind {
            TargetKind::Tern(t) => t.finish_reads().await.map(|_| None),
            TargetKind::Raw(_) | TargetKind::Redis(_) => Ok(None),
            TargetKind::File(f) => f.finish_reads(size),
        }
    }

    pub(super) async fn measure(&mut self, cell: Cell, options: &IoOptions) -> anyhow::Result<CellResult> {
        let budget = cell.budget(options);
        let samples = match &mut self.kind {
            TargetKind::Tern(t) => t.measure(cell, budget).await?,
            TargetKind::Raw(r) => r.measure(cell, budget).await?,
            TargetKind::Redis(r) => r.measure(cell, budget).await?,
            TargetKind::File(f) => f.measure(cell, budget).await?,
        };
        Ok(CellResult::of_samples(self.system, cell, &samples))
    }

    pub(super) async fn stop(self) {
        match self.kind {
            TargetKind::Tern(t) => drop(t),
            TargetKind::Raw(r) => drop(r),
            TargetKind::Redis(r) => r.stop().await,
            TargetKind::File(f) => drop(f),
        }
    }
}
