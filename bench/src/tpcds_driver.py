"""The Spark application of `tern bench tpcds` (bench/src/tpcds.rs), run by spark-submit.

    tpcds_driver.py DATA_DIR QUERIES_DIR QUERY[,QUERY...] LIMIT_SECONDS

Maps every DATA_DIR/<table>.parquet (tpcgen-cli's layout) to a temporary view, then runs each
QUERY (QUERIES_DIR/<query>.sql, the Spark kit's texts) in turn in this one application, each
within LIMIT_SECONDS (its jobs are cancelled past it). Per query it prints one line to stdout,
`TPCDS-QUERY {"name", "seconds", "rows", "error"}`, with every row collected (decimals as
strings, so they compare exactly; doubles as numbers) or the error Spark raised; at the end
`TPCDS {"seconds"}`, the application's seconds over the queries. A failing query does not stop
the others: the bench reports it.
"""

import datetime
import decimal
import json
import math
import os
import sys
import threading
import time

from pyspark.sql import SparkSession


def cell(value):
    """One value of a result row, as JSON the bench compares."""
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    return value


def first_line(error):
    """The line of a Spark error that says what went wrong: for an error in the JVM its exception's
    own message, not py4j's "An error occurred while calling ..." above it."""
    java = getattr(error, "java_exception", None)
    text = str(java.toString()) if java is not None else str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def run_query(spark, name, text, limit_s):
    context = spark.sparkContext
    context.setJobGroup(name, name, interruptOnCancel=True)
    timer = threading.Timer(limit_s, context.cancelJobGroup, [name])
    timer.start()
    start = time.monotonic()
    try:
        rows = [[cell(v) for v in row] for row in spark.sql(text).collect()]
        return {"name": name, "seconds": time.monotonic() - start, "rows": rows, "error": None}
    except Exception as error:  # Reported, not hidden: the bench lists failing queries.
        seconds = time.monotonic() - start
        message = first_line(error)
        if seconds >= limit_s:
            message = f"cancelled past its limit of {limit_s} s: {message}"
        return {"name": name, "seconds": seconds, "rows": None, "error": message}
    finally:
        timer.cancel()


def main():
    data, queries_dir, names, limit_s = sys.argv[1], sys.argv[2], sys.argv[3].split(","), float(sys.argv[4])
    spark = SparkSession.builder.appName("tern-bench-tpcds").getOrCreate()
    tables = sorted(f[: -len(".parquet")] for f in os.listdir(data) if f.endswith(".parquet"))
    if not tables:
        sys.exit(f"no <table>.parquet in {data}")
    for table in tables:
        spark.read.parquet(os.path.join(data, f"{table}.parquet")).createOrReplaceTempView(table)
    start = time.monotonic()
    for name in names:
        with open(os.path.join(queries_dir, f"{name}.sql")) as f:
            text = f.read()
        result = run_query(spark, name, text, limit_s)
        print("TPCDS-QUERY " + json.dumps(result), flush=True)
    print("TPCDS " + json.dumps({"seconds": time.monotonic() - start}), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
