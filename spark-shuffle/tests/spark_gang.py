"""A gang of Spark executors on Tern's scheduler, run as a user would after `tern up`: by a bare
`spark-submit` with SPARK_CONF_DIR set to the directory `tern up` wrote (no --master, no shuffle
settings), asking for 3 executors that start together (`spark.tern.gang.minExecutors=3`) on a pool
that holds only 2 (tests/integration/spark.rs, `a_spark_gang_starts_together_with_tern_ups_spark_defaults`).

The test (outside) watches the Tern side: no executor task runs while the pool holds 2, and all 3
start in one step once it starts a third `tern executor` at the time it writes to TERN_GANG_START.
This script checks the Spark side: the master and the shuffle manager came from `tern up`'s
defaults; no executor registers with the driver before that time; all 3 register within
REGISTER_WINDOW_S of each other; a shuffle computes the right result in the application job's own
Tern job, on Tern's storage servers (their shuffle segments, TERN_STORAGE_METRICS). It prints each
executor's registration time for the test.

Environment: TERN_SPARK_MASTER (the master `tern up` wrote), TERN_GANG_START (a file holding the
third executor's start, Unix ms), TERN_STORAGE_METRICS (the storage servers' metrics URLs, comma
separated).
"""

import os
import time
import urllib.request

from pyspark import SparkContext

GANG = 3
# Bounds on the waits: Spark's own start is slow on a loaded 2-core machine.
WAIT_S = 90
# How far apart the gang's executors may register: their JVMs start at once, but on 2 cores.
REGISTER_WINDOW_S = 15


def executors(sc):
    """The executors registered with the driver (not the driver): id -> registration time (Unix ms)."""
    out = {}
    summaries = sc._jsc.sc().statusStore().executorList(True)
    for i in range(summaries.size()):
        e = summaries.apply(i)
        if e.id() != "driver":
            out[e.id()] = e.addTime().getTime()
    return out


def shuffle_segments():
    total = 0
    for url in os.environ["TERN_STORAGE_METRICS"].split(","):
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            if line.startswith("tern_storage_shuffle_segments "):
                total += int(float(line.split()[1]))
    return total


def main():
    # Nothing here names the master or the shuffle: they come from SPARK_CONF_DIR.
    sc = SparkContext(appName="gang")
    try:
        conf = sc.getConf()
        master = conf.get("spark.master")
        assert master == os.environ["TERN_SPARK_MASTER"], f"master {master}, not tern up's"
        manager = sc._jsc.sc().env().shuffleManager().getClass().getName()
        assert manager == "io.tern.spark.TernShuffleManager", f"shuffle manager {manager}"
        print(f"  ok  master {master} and shuffle manager {manager} from SPARK_CONF_DIR", flush=True)

        # The test starts the third executor once it has seen the gang wait; none registers before.
        start_file = os.environ["TERN_GANG_START"]
        deadline = time.time() + WAIT_S
        while not (os.path.exists(start_file) and open(start_file).read().strip()):
            assert not executors(sc), f"executors registered before the gang could start: {executors(sc)}"
            assert time.time() < deadline, f"the test did not start the third executor within {WAIT_S} s"
            time.sleep(0.2)
        started_ms = int(open(start_file).read().strip())
        while len(executors(sc)) < GANG:
            assert time.time() < deadline, f"only {executors(sc)} registered within {WAIT_S} s"
            time.sleep(0.2)
        times = executors(sc)
        for eid, at in sorted(times.items()):
            print(f"registered executor {eid} at {at}", flush=True)
        assert len(times) == GANG, f"{times}: more than the gang"
        assert min(times.values()) >= started_ms, \
            f"an executor registered before the third Tern executor started ({started_ms}): {times}"
        spread_s = (max(times.values()) - min(times.values())) / 1000
        assert spread_s <= REGISTER_WINDOW_S, f"the gang registered over {spread_s:.1f} s: {times}"
        print(f"  ok  {GANG} executors registered within {spread_s:.1f} s of each other, none before the "
              f"capacity for all of them", flush=True)

        assert shuffle_segments() == 0, "shuffle segments on Tern before any shuffle"
        counts = dict(sc.parallelize(range(3000), 6).map(lambda x: (x % 7, 1)).reduceByKey(lambda a, b: a + b, 3)
                      .collect())
        assert counts == {k: len(range(k, 3000, 7)) for k in range(7)}, f"wrong counts {counts}"
        segments = shuffle_segments()
        assert segments > 0, "the shuffle left no segment on Tern's storage servers"
        jsc = sc._jsc.sc()
        shuffles, app_job = jsc.env().shuffleManager().ternJobId(), jsc.schedulerBackend().ternJobId()
        print(f"  ok  a shuffle counted right, {segments} segments on Tern's storage servers, in Tern job "
              f"{shuffles} (scheduler job {app_job})", flush=True)
    finally:
        sc.stop()
    print("gang done", flush=True)


if __name__ == "__main__":
    main()
