//! The operators a stage may name: one enum that the scheduler (which executors run a stage, what
//! a job may ask) and the executor (what a task runs) both match on. The wire keeps the names
//! (`pb::Operator.name`, `RegisterExecutor.operators`), so every edge parses a name into an
//! [`Operator`] once and the code behind it never compares strings.

use std::fmt;
use std::str::FromStr;

/// A built-in operator, or `command` (any executable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operator {
    /// Nothing (for dispatch benchmarks and tests).
    Noop,
    /// TeraSort's generator: task i writes part i.
    Teragen,
    /// TeraSort's map: input parts, range-partitioned into the output shuffle.
    TerasortMap,
    /// TeraSort's reduce on the CPU.
    TerasortReduce,
    /// TeraSort's reduce on a granted GPU (the CPU when the stage is `gpu_optional` and none is usable).
    TerasortReduceGpu,
    /// Any executable, with the task's environment.
    Command,
    /// A Spark executor JVM serving a Spark application on Tern's scheduler.
    SparkExecutor,
}

impl Operator {
    /// Every operator, in the order their names are listed to users.
    pub const ALL: [Operator; 7] = [
        Operator::Noop,
        Operator::Teragen,
        Operator::TerasortMap,
        Operator::TerasortReduce,
        Operator::TerasortReduceGpu,
        Operator::Command,
        Operator::SparkExecutor,
    ];

    /// The name job files and the wire use.
    pub fn name(self) -> &'static str {
        match self {
            Operator::Noop => "noop",
            Operator::Teragen => "teragen",
            Operator::TerasortMap => "terasort-map",
            Operator::TerasortReduce => "terasort-reduce",
            Operator::TerasortReduceGpu => "terasort-reduce-gpu",
            Operator::Command => "command",
            Operator::SparkExecutor => "spark-executor",
        }
    }

    /// Every name, comma-separated (for messages that say what is known).
    pub fn names() -> String {
        Operator::ALL.map(Operator::name).join(", ")
    }

    /// Whether a stage of it may carry environment variables (`command`; and `spark-executor`,
    /// for SPARK_HOME and the PYTHONPATH of the executor's Python workers).
    pub fn takes_env(self) -> bool {
        matches!(self, Operator::Command | Operator::SparkExecutor)
    }

    /// Whether its tasks write the parts of a store directory, where the first whole attempt of a
    /// part wins (so a job must not write where an earlier run left parts).
    pub fn writes_parts(self) -> bool {
        matches!(self, Operator::Teragen | Operator::TerasortReduce | Operator::TerasortReduceGpu)
    }
}

impl fmt::Display for Operator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is no operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown operator {0:?}; known: {names}", names = Operator::names())]
pub struct UnknownOperator(pub String);

impl FromStr for Operator {
    type Err = UnknownOperator;

    fn from_str(name: &str) -> Result<Operator, UnknownOperator> {
        Operator::ALL.into_iter().find(|o| o.name() == name).ok_or_else(|| UnknownOperator(name.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_to_its_operator() {
        for op in Operator::ALL {
            assert_eq!(op.name().parse::<Operator>(), Ok(op));
        }
        let e = "sortt".parse::<Operator>().unwrap_err();
        assert_eq!(e.to_string(), format!("unknown operator \"sortt\"; known: {}", Operator::names()));
        assert!(Operator::names().starts_with("noop, teragen, terasort-map"));
    }
}
