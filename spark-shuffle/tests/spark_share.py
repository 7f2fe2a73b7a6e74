"""One of two Spark applications sharing Tern's executors by queue weight (tests/integration/spark.rs,
`two_spark_applications_share_executors_by_queue_weight`): an application in queue TERN_QUEUE
that wants TERN_EXECUTORS executors of one core and keeps them busy with jobs of short tasks until
the file TERN_STOP exists. It prints how many executors registered with its driver, so the test can
hold Spark's view against the executor time it measured from Tern's side.

Environment: TERN_METADATA, TERN_SPARK_JAR, TERN_SPARK_MASTER (local-cluster-tern://HOST:PORT), TERN_QUEUE,
TERN_EXECUTORS, TERN_STOP.
"""

import os
import time

from pyspark import SparkConf, SparkContext

JAR = os.environ["TERN_SPARK_JAR"]
# A bound on the whole run, far above the test's window: an application never outlives a lost test.
RUN_LIMIT_S = 240


def main():
    queue = os.environ["TERN_QUEUE"]
    conf = (
        SparkConf()
        .setMaster(os.environ["TERN_SPARK_MASTER"])
        .setAppName(f"share-{queue}")
        .set("spark.driver.extraClassPath", JAR)
        .set("spark.executor.extraClassPath", JAR)
        .set("spark.shuffle.manager", "io.tern.spark.TernShuffleManager")
        .set("spark.shuffle.sort.io.plugin.class", "io.tern.spark.TernShuffleDataIO")
        .set("spark.tern.metadata", os.environ["TERN_METADATA"])
        .set("spark.tern.queue", queue)
        # The queue is a tenant's: the driver submits into it with that tenant's credential.
        .set("spark.tern.credentialFile", os.environ["TERN_CREDENTIAL_FILE"])
        .set("spark.executor.instances", os.environ["TERN_EXECUTORS"])
        .set("spark.executor.cores", "1")
        .set("spark.executor.memory", "512m")
        .set("spark.driver.memory", "512m")
        .set("spark.ui.enabled", "false")
    )
    sc = SparkContext(conf=conf)
    seen = 0
    jobs = 0
    try:
        deadline = time.time() + RUN_LIMIT_S
        while not os.path.exists(os.environ["TERN_STOP"]):
            assert time.time() < deadline, f"no stop file within {RUN_LIMIT_S} s"
            # 24 tasks of 0.2 s: every executor the application holds stays busy.
            sc.parallelize(range(24), 24).foreach(lambda _: time.sleep(0.2))
            jobs += 1
            # The driver is one of the infos.
            seen = max(seen, len(sc._jsc.sc().statusTracker().getExecutorInfos()) - 1)
    finally:
        sc.stop()
    print(f"queue {queue}: {seen} executors registered, {jobs} jobs run", flush=True)
    print("share app done", flush=True)


if __name__ == "__main__":
    main()
