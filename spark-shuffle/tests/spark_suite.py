"""Tern's Spark shuffle plugin on real Spark (pyspark 3.5.3, local-cluster[2,1,1024]).

Runs every case once on Spark's built-in shuffle and once on Tern (one SparkContext each) and
fails if any result differs, if AQE did not split the skewed join, if a job cannot survive a
killed storage server, or if the TeraSort output does not validate with the input's checksum.

Environment: TERN_METADATA (host:port of a running cluster), TERN_SPARK_JAR, TERN_BIN (the tern
binary), TERN_KILL_PID (a storage server of that cluster this suite may SIGKILL), TERN_WORK (a
scratch directory).
"""

import json
import os
import signal
import subprocess
import sys
import time
from operator import add

from pyspark import SparkConf, SparkContext
from pyspark.sql import SparkSession, Window
from pyspark.sql import functions as F

METADATA = os.environ["TERN_METADATA"]
JAR = os.environ["TERN_SPARK_JAR"]
TERN = os.environ["TERN_BIN"]
KILL_PID = int(os.environ["TERN_KILL_PID"])
WORK = os.environ["TERN_WORK"]
TERASORT_BYTES = int(os.environ.get("TERN_TERASORT_BYTES", str(24 << 20)))


def spark(tern):
    conf = (
        SparkConf()
        .setMaster("local-cluster[2,1,1024]")
        .setAppName("tern-suite-" + ("tern" if tern else "builtin"))
        .set("spark.driver.extraClassPath", JAR)
        .set("spark.executor.extraClassPath", JAR)
        .set("spark.executor.memory", "700m")
        .set("spark.ui.enabled", "false")
        .set("spark.sql.shuffle.partitions", "8")
        .set("spark.sql.autoBroadcastJoinThreshold", "-1")
        .set("spark.sql.adaptive.enabled", "true")
        .set("spark.sql.adaptive.localShuffleReader.enabled", "false")
        .set("spark.sql.adaptive.skewJoin.enabled", "true")
        .set("spark.sql.adaptive.skewJoin.skewedPartitionThresholdInBytes", "1k")
        .set("spark.sql.adaptive.skewJoin.skewedPartitionFactor", "1")
        .set("spark.sql.adaptive.advisoryPartitionSizeInBytes", "1k")
        .set("spark.stage.maxConsecutiveAttempts", "8")
    )
    if tern:
        conf = (
            conf.set("spark.shuffle.manager", "io.tern.spark.TernShuffleManager")
            .set("spark.shuffle.sort.io.plugin.class", "io.tern.spark.TernShuffleDataIO")
            .set("spark.tern.metadata", METADATA)
        )
    sc = SparkContext(conf=conf)
    manager = sc._jsc.sc().env().shuffleManager().getClass().getName()
    expected = "io.tern.spark.TernShuffleManager" if tern else "org.apache.spark.shuffle.sort.SortShuffleManager"
    assert manager == expected, f"shuffle manager is {manager}, wanted {expected}"
    return sc, SparkSession(sc)


def rdd_cases(sc):
    nums = sc.parallelize(range(30000), 4)
    a = sc.parallelize([(i % 50, i) for i in range(3000)], 3)
    b = sc.parallelize([(i % 70, -i) for i in range(2000)], 2)
    keys = list(range(20000))
    keys = keys[7::13] + [k for k in keys if (k - 7) % 13 != 0]
    return {
        "rdd.reduceByKey": sorted(nums.map(lambda x: (x % 97, x)).reduceByKey(add, 5).collect()),
        "rdd.groupByKey": sorted(
            nums.map(lambda x: (x % 41, x)).groupByKey(3).mapValues(lambda v: sorted(v)).collect()
        ),
        # Order is the result: no sorting afterwards.
        "rdd.sortByKey": sc.parallelize([(k, str(k)) for k in keys], 4).sortByKey(numPartitions=5).collect(),
        "rdd.join": sorted(a.join(b, 4).collect()),
        "rdd.cogroup": sorted(
            (k, (sorted(x), sorted(y))) for k, (x, y) in a.cogroup(b, 3).collect()
        ),
    }


def jvm_cases(sc):
    cases = sc._jvm.io.tern.spark.tools.JvmCases
    return {
        "jvm.reduceByKey(map-side combine)": cases.reduceByKey(sc._jsc),
        "jvm.groupByKey": cases.groupByKey(sc._jsc),
        "jvm.sortByKey(ExternalSorter)": cases.sortByKey(sc._jsc),
        "jvm.aggregateByKey": cases.aggregateByKey(sc._jsc),
    }


def sql_cases(session):
    facts = session.range(0, 20000).select(
        # Key 0 holds half the rows: AQE sees a skewed partition and splits it by map ranges.
        F.when(F.col("id") % 2 == 0, F.lit(0)).otherwise(F.col("id") % 100).alias("k"),
        F.col("id").alias("v"),
    )
    dims = session.range(0, 100).select(F.col("id").alias("k"), (F.col("id") * 10).alias("w"))
    joined = facts.join(dims, "k")
    rows = sorted(tuple(r) for r in joined.collect())
    plan = joined._jdf.queryExecution().executedPlan().toString()
    assert "skew=true" in plan, "AQE did not split the skewed join:\n" + plan
    window = Window.partitionBy("k").orderBy(F.col("v").desc())
    return {
        "sql.groupBy.agg": sorted(
            tuple(r) for r in facts.groupBy("k").agg(F.count("*"), F.sum("v"), F.max("v")).collect()
        ),
        "sql.join(skew split)": rows,
        "sql.orderBy": [tuple(r) for r in facts.orderBy(F.col("v").desc()).limit(3000).collect()],
        "sql.orderBy(full)": [r[0] for r in facts.orderBy("k", "v").select("v").collect()],
        "sql.window": sorted(
            tuple(r) for r in facts.withColumn("rank", F.row_number().over(window)).where("rank <= 3").collect()
        ),
    }


def teragen():
    data = os.path.join(WORK, "teragen")
    out = subprocess.run(
        [TERN, "teragen", "--local", "--size", str(TERASORT_BYTES), "--out", data, "--parts", "3"],
        check=True, capture_output=True, text=True,
    ).stdout
    checksum = next(line.split()[1] for line in out.splitlines() if line.startswith("Checksum:"))
    return data, checksum


def terasort(sc, data, name):
    out = os.path.join(WORK, "terasort-" + name)
    report = json.loads(sc._jvm.io.tern.spark.tools.TeraSort.run(sc._jsc, data, out, 5))
    valid = subprocess.run(
        [TERN, "teravalidate", "--local", "--json", out], check=True, capture_output=True, text=True
    ).stdout
    return report, json.loads(valid)


def survive_lost_server(sc):
    """Runs a shuffle, kills a storage server, reads the shuffle again: the lost maps rerun."""
    rdd = sc.parallelize(range(40000), 6).map(lambda x: (x % 31, x)).reduceByKey(add, 6)
    expected = sorted((k, sum(x for x in range(40000) if x % 31 == k)) for k in range(31))
    first = sorted(rdd.collect())
    assert first == expected, "shuffle before the kill is wrong"
    os.kill(KILL_PID, signal.SIGKILL)
    time.sleep(4)  # the metadata server declares it dead after its server timeout
    second = sorted(rdd.collect())
    assert second == expected, "shuffle after losing a storage server is wrong"


def run(tern):
    sc, session = spark(tern)
    try:
        results = {}
        for name, cases in [("rdd", lambda: rdd_cases(sc)), ("jvm", lambda: jvm_cases(sc)),
                            ("sql", lambda: sql_cases(session))]:
            t = time.time()
            results.update(cases())
            print(f"  {'tern' if tern else 'builtin'} {name} cases: {time.time() - t:.1f}s", flush=True)
        return sc, session, results
    except BaseException:
        sc.stop()
        raise


def main():
    data, input_checksum = teragen()
    failures = []

    sc, _, builtin = run(tern=False)
    try:
        report, valid = terasort(sc, data, "builtin")
        print("  builtin terasort:", report, valid, flush=True)
        if not valid["sorted"] or valid["checksum"] != input_checksum:
            failures.append(f"built-in terasort output invalid: {valid} (input checksum {input_checksum})")
    finally:
        sc.stop()

    sc, _, tern = run(tern=True)
    try:
        for name, expected in builtin.items():
            if tern[name] != expected:
                failures.append(f"{name}: Tern's result differs from the built-in shuffle's")
            else:
                print(f"  ok  {name}", flush=True)
        report, valid = terasort(sc, data, "tern")
        print("  tern terasort:", report, valid, flush=True)
        if not valid["sorted"] or valid["checksum"] != input_checksum or valid["records"] != report["records"]:
            failures.append(f"Tern terasort output invalid: {valid} (input checksum {input_checksum})")
        else:
            print("  ok  terasort output validates (checksum %s)" % input_checksum, flush=True)
        survive_lost_server(sc)
        print("  ok  a killed storage server: lost maps recomputed, result right", flush=True)
    finally:
        sc.stop()

    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), flush=True)
        sys.exit(1)
    print("all Spark cases agree", flush=True)


if __name__ == "__main__":
    main()
