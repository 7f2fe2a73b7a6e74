"""GPUs for Spark executors on Tern's scheduler, on a machine without GPUs: the Tern executor's
discovery script names GPUs 0 and 1 (`tern up --executor-gpu-discovery-script`); the application asks for two executors of one
GPU each (`spark.executor.resource.gpu.amount=1`) and one GPU per task. Every task must see in
`TaskContext.resources()` exactly the device its executor was granted, `CUDA_VISIBLE_DEVICES`
must name that same device, and the two executors must hold different devices. The application's
Tern job must show its executors' GPU grants were honoured (both ran at once on one Tern executor
with two GPUs).

Then `tern job list` shows the application running in its queue (`spark.tern.queue`) at its
priority (`spark.tern.priority`), its shuffles in the application job's own Tern job, and `tern job
cancel` stops it and frees that Tern job (its shuffles with it).

Environment: TERN_METADATA, TERN_SPARK_JAR, TERN_BIN, TERN_SPARK_MASTER (local-cluster-tern://HOST:PORT).
"""

import json
import os
import subprocess
import time

from pyspark import SparkConf, SparkContext, TaskContext

JAR = os.environ["TERN_SPARK_JAR"]


def probe(_):
    ctx = TaskContext.get()
    gpus = ctx.resources()["gpu"].addresses
    time.sleep(0.5)  # keep both executors busy at once
    return [(os.environ.get("CUDA_VISIBLE_DEVICES", ""), list(gpus), os.getpid())]


def tern_jobs():
    """The live Tern jobs' ids, as the metadata server lists them."""
    status = subprocess.run([os.environ["TERN_BIN"], "status", "--json", "--metadata", os.environ["TERN_METADATA"]],
                            check=True, capture_output=True, text=True).stdout
    return {j["job_id"] for j in json.loads(status)["jobs"]}


def main():
    conf = (
        SparkConf()
        .setMaster(os.environ["TERN_SPARK_MASTER"])
        .setAppName("tern-gpus")
        .set("spark.driver.extraClassPath", JAR)
        .set("spark.executor.extraClassPath", JAR)
        .set("spark.shuffle.manager", "io.tern.spark.TernShuffleManager")
        .set("spark.shuffle.sort.io.plugin.class", "io.tern.spark.TernShuffleDataIO")
        .set("spark.tern.metadata", os.environ["TERN_METADATA"])
        .set("spark.executor.memory", "512m")
        .set("spark.executor.instances", "2")
        .set("spark.executor.resource.gpu.amount", "1")
        .set("spark.task.resource.gpu.amount", "1")
        .set("spark.ui.enabled", "false")
        .set("spark.tern.queue", "gpu-team")
        # The queue is tenant gpu-team's: the driver submits into it with that tenant's credential.
        .set("spark.tern.credentialFile", os.environ["TERN_CREDENTIAL_FILE"])
        .set("spark.tern.priority", "3")
    )
    sc = SparkContext(conf=conf)
    try:
        jsc = sc._jsc.sc()
        deadline = time.time() + 90
        while len(jsc.statusTracker().getExecutorInfos()) - 1 < 2:
            assert time.time() < deadline, "two GPU executors did not register within 90 s"
            time.sleep(0.2)
        seen = sc.parallelize(range(8), 8).mapPartitions(lambda it: probe(it)).collect()
        by_worker = {}
        for visible, granted, pid in seen:
            assert len(granted) == 1 and visible == granted[0], \
                f"a task saw CUDA_VISIBLE_DEVICES={visible!r} but was given GPUs {granted}"
            by_worker.setdefault(visible, set()).add(pid)
        devices = sorted(by_worker)
        assert devices == ["0", "1"], f"the two executors did not hold GPUs 0 and 1: {devices} ({seen})"
        print(f"  ok  8 tasks on 2 executors: each saw its executor's one GPU in TaskContext.resources() and "
              f"CUDA_VISIBLE_DEVICES; devices {devices}, never shared", flush=True)
        # `tern job cancel` ends the application like any Tern job.
        job = jsc.schedulerBackend().ternJobId()
        scheduler = os.environ["TERN_SPARK_MASTER"].split("://", 1)[1]
        as_tenant = ["--as", os.environ["TERN_CREDENTIAL_FILE"]]
        listed = subprocess.run([os.environ["TERN_BIN"], "job", "list", "--json", "--scheduler", scheduler] + as_tenant,
                                check=True, capture_output=True, text=True).stdout
        mine = [j for j in json.loads(listed) if j["job_id"] == job]
        assert mine and mine[0]["state"] == "running" and (mine[0]["queue"], mine[0]["priority"]) == ("gpu-team", 3), \
            f"the application's job as tern job list shows it: {mine} (wanted queue gpu-team, priority 3)"
        # A shuffle: it lives in the application job's Tern job.
        counts = dict(sc.parallelize(range(1000), 4).map(lambda x: (x % 7, 1)).reduceByKey(lambda a, b: a + b).collect())
        assert counts == {k: len(range(k, 1000, 7)) for k in range(7)}, f"a shuffle on the GPU executors: {counts}"
        shuffles = jsc.env().shuffleManager().ternJobId()
        assert shuffles == mine[0]["tern_job_id"], \
            f"the shuffles are in Tern job {shuffles}, not the application job's {mine[0]['tern_job_id']}"
        assert shuffles in tern_jobs(), f"Tern job {shuffles} is not live"
        subprocess.run([os.environ["TERN_BIN"], "job", "cancel", job, "--scheduler", scheduler] + as_tenant,
                       check=True, capture_output=True)
        deadline = time.time() + 30
        while not jsc.isStopped():
            assert time.time() < deadline, "the application did not stop after tern job cancel"
            time.sleep(0.2)
        while shuffles in tern_jobs():
            assert time.time() < deadline, f"Tern job {shuffles} (the shuffles) outlived tern job cancel"
            time.sleep(0.2)
        print(f"  ok  tern job list showed {job} running in queue gpu-team at priority 3 with its shuffles in its "
              f"Tern job {shuffles}; tern job cancel stopped the application and freed that job", flush=True)
    finally:
        sc.stop()
    print(f"GPU executors right ({job})", flush=True)


if __name__ == "__main__":
    main()
