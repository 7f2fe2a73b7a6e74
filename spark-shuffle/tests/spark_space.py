"""Tern's Spark plugin under storage pressure (pyspark 3.5.3, local-cluster[2,1,1024]).

A long application runs shuffle-heavy queries one after another on a cluster whose DRAM holds
about two of their shuffles (no NVMe tier). Spark frees a shuffle only when its ContextCleaner
sees the shuffle's dependency garbage-collected on the driver, so the finished queries' shuffles
pile up in Tern unless the plugin has the driver collect garbage. Three applications, in turn:

1. cleanup off (spark.tern.cleanerThreshold=0, spark.tern.spaceWait=0): a query fails with
   out-of-space after Spark's 4 task attempts; this is what the other two must prevent.
2. proactive (cleanerThreshold a quarter of one shuffle, no wait): every query is right, and the
   plugin collected garbage because the application's shuffle bytes passed the threshold (a push
   that races a free still fails its task, which Spark retries: there is no wait here).
3. reactive (no threshold, spaceWait on): every query is right, pushes that find the cluster full
   wait while the driver collects garbage; then a query whose one shuffle exceeds the cluster
   fails within the wait, with a message naming what is full and what to do, and its stage is
   cancelled instead of retried.

Environment: TERN_METADATA (host:port of the cluster), TERN_SPARK_JAR, TERN_BIN (the tern binary).
Prints one "ok" line per case and "storage pressure handled" at the end; exits 1 on a failure.
"""

import json
import os
import subprocess
import sys
import time

from pyspark import SparkConf, SparkContext

METADATA = os.environ["TERN_METADATA"]
JAR = os.environ["TERN_SPARK_JAR"]
TERN = os.environ["TERN_BIN"]
# One query's shuffle: RECORDS records of RECORD_BYTES random bytes (~30 MiB, incompressible).
RECORDS = 30 * 1024
RECORD_BYTES = 1024
QUERIES = 5
SPACE_WAIT_S = 10


def spark(name, extra):
    conf = (
        SparkConf()
        .setMaster("local-cluster[2,1,1024]")
        .setAppName("tern-space-" + name)
        .set("spark.driver.extraClassPath", JAR)
        .set("spark.executor.extraClassPath", JAR)
        .set("spark.executor.memory", "700m")
        # A roomy driver heap, as a long application's driver has: its young generation does not
        # fill (and so collect the finished queries' shuffles by chance) during this test. The
        # JVM is launched once, with the first application's settings.
        .set("spark.driver.memory", "2g")
        .set("spark.driver.extraJavaOptions", "-Xmn1g")
        .set("spark.ui.enabled", "false")
        .set("spark.shuffle.manager", "io.tern.spark.TernShuffleManager")
        .set("spark.shuffle.sort.io.plugin.class", "io.tern.spark.TernShuffleDataIO")
        .set("spark.tern.metadata", METADATA)
        .set("spark.tern.storageClass", "dram")
        .set("spark.tern.cleanerInterval", "1s")
    )
    for key, value in extra:
        conf = conf.set(key, value)
    return SparkContext(conf=conf)


def tern_status():
    return json.loads(subprocess.run([TERN, "status", "--json", "--metadata", METADATA], check=True,
                                     capture_output=True, text=True).stdout)


def held_bytes():
    return sum(t["used_bytes"] for s in tern_status()["servers"] if s["alive"] for t in s["tiers"])


def wait_for(what, check, timeout):
    deadline = time.time() + timeout
    while not check():
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def query(sc, seed, records=RECORDS):
    jobs = sc._jvm.io.tern.spark.tools.PressureJobs
    got = jobs.shuffle(sc._jsc, seed, records, RECORD_BYTES, 4)
    assert got == jobs.expected(seed, records, RECORD_BYTES), f"query {seed}: wrong result {got}"


def queries(sc):
    for seed in range(QUERIES):
        t = time.time()
        query(sc, seed)
        print(f"    query {seed}: right, {time.time() - t:.1f}s", flush=True)


def failure_of(action):
    try:
        action()
    except Exception as e:  # py4j's Py4JJavaError: the Java exception's text is in str(e)
        return str(e)
    raise AssertionError("expected the query to fail, and it succeeded")


def stopped(sc):
    job = sc._jsc.sc().env().shuffleManager().ternJobId()
    sc.stop()
    wait_for(f"application end to free Tern job {job}", lambda: held_bytes() == 0, 15)


def cleanup_off():
    sc = spark("off", [("spark.tern.cleanerThreshold", "0"), ("spark.tern.spaceWait", "0")])
    try:
        def run():
            for seed in range(QUERIES):
                query(sc, seed)
                print(f"    query {seed}: right", flush=True)
        error = failure_of(run)
        assert "out-of-space" in error and "failed 4 times" in error, error[:3000]
        assert sc._jsc.sc().env().shuffleManager().cleanerCollections() == 0
    finally:
        stopped(sc)
    print("  ok  cleanup off: a later query fails with out-of-space after 4 task attempts", flush=True)


def proactive():
    # The threshold's collection runs in the background and Spark's ContextCleaner frees
    # asynchronously, so the next query's pushes can still find the cluster full for a moment: a
    # short wait is the backstop, as in production (without it this raced on a loaded machine).
    settings = [("spark.tern.cleanerThreshold", "8m"), ("spark.tern.cleanerInterval", "100ms"),
                ("spark.tern.spaceWait", "5s")]
    sc = spark("proactive", settings)
    try:
        queries(sc)
        collections = sc._jsc.sc().env().shuffleManager().cleanerCollections()
        assert collections > 0, "the threshold never had the driver collect garbage"
    finally:
        stopped(sc)
    print(f"  ok  proactive: {QUERIES} queries right, {collections} driver collections (threshold, wait as backstop)",
          flush=True)


def reactive():
    sc = spark("reactive", [("spark.tern.cleanerThreshold", "0"), ("spark.tern.spaceWait", f"{SPACE_WAIT_S}s")])
    try:
        queries(sc)
        manager = sc._jsc.sc().env().shuffleManager()
        collections = manager.cleanerCollections()
        assert collections > 0, "no push ever waited for space: the cluster is not as small as this test needs"
        print(f"  ok  reactive: {QUERIES} queries right, {collections} driver collections while pushes waited",
              flush=True)

        log = sc._jvm.io.tern.spark.tools.StageLog()
        sc._jsc.sc().addSparkListener(log)
        t = time.time()
        # One shuffle four times the size of the others: more than the whole cluster holds.
        error = failure_of(lambda: query(sc, 99, records=4 * RECORDS))
        took = time.time() - t
        for words in ["cancelled because Tern has no room for this application's shuffle output",
                      "is full", "dram tier full", "spark.tern.storageClass=any", "spark.tern.spaceWait",
                      "Spark does not retry this task"]:
            assert words in error, f"the failure does not say {words!r}:\n{error[:3000]}"
        assert "failed 4 times" not in error, error[:3000]
        sc._jsc.sc().listenerBus().waitUntilEmpty()
        seen = json.loads(log.json())
        failed = [t for t in seen["tasks"] if t[3] == 0]
        retried = [t for t in failed if any(u[2] == t[2] and u[0] == t[0] and u is not t for u in seen["tasks"])]
        assert not retried, f"a task was retried: {seen}"
        assert took < 3 * SPACE_WAIT_S, f"failing took {took:.1f}s with a {SPACE_WAIT_S}s wait"
    finally:
        stopped(sc)
    said = next(line for line in error.splitlines() if "Tern has no room" in line)
    print(f"  ok  a shuffle larger than the cluster fails in {took:.1f}s (wait {SPACE_WAIT_S}s), "
          f"stage cancelled, not retried; it says:\n      {said.strip()}", flush=True)


def main():
    for case in [cleanup_off, proactive, reactive]:
        t = time.time()
        case()
        print(f"    ({case.__name__}: {time.time() - t:.1f}s)", flush=True)
    print("storage pressure handled", flush=True)


if __name__ == "__main__":
    main()
