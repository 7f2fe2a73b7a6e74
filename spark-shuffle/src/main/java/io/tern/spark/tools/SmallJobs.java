package io.tern.spark.tools;

import static org.apache.spark.sql.functions.col;
import static org.apache.spark.sql.functions.expr;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.function.Function;

import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.expressions.Window;

/**
 * A suite of small Spark SQL jobs, each a few shuffles over a few hundred thousand rows: the
 * shape of the interactive and scheduled queries where a shuffle service's fixed costs (per
 * shuffle, per map task, per partition) show, not its bandwidth. Spark's defaults are kept
 * (200 shuffle partitions, adaptive execution on), except broadcast joins, which are off so that
 * every join shuffles.
 *
 * <p>{@code spark-submit --class io.tern.spark.tools.SmallJobs JAR [ROWS [JOB,JOB...]]} runs every
 * job (or the ones named) once, in order, on ROWS rows (100000) and prints one line
 * {@code SMALLJOBS {json}}: each job's seconds and the digest of its result
 * (row count and the sum of the rows' hashes, which does not depend on row order), so two runs
 * with different shuffles can be compared job by job.
 */
public final class SmallJobs {
    private SmallJobs() {}

    public static void main(String[] args) {
        long rows = args.length > 0 ? Long.parseLong(args[0]) : 100_000L;
        List<String> only = args.length > 1 ? java.util.Arrays.asList(args[1].split(",")) : null;
        SparkSession spark = SparkSession.builder()
                .appName("tern-small-jobs")
                .config("spark.sql.autoBroadcastJoinThreshold", "-1")
                .getOrCreate();
        try {
            System.out.println("SMALLJOBS " + run(spark, rows, only));
        } finally {
            spark.stop();
        }
    }

    /** The jobs by name, in the order they run; each builds its query from the session. */
    static Map<String, Function<SparkSession, Dataset<Row>>> jobs(long rows) {
        Map<String, Function<SparkSession, Dataset<Row>>> jobs = new LinkedHashMap<>();
        Function<SparkSession, Dataset<Row>> facts = s -> s.range(rows)
                .selectExpr("id", "id % 97 as a", "id % 1009 as b", "cast(id * 7 % 10007 as string) as c", "id * 0.5 as v");
        jobs.put("group_count", s -> facts.apply(s).groupBy("a").count());
        jobs.put("group_sum_avg", s -> facts.apply(s).groupBy("b").agg(expr("sum(v)"), expr("avg(id)")));
        jobs.put("distinct", s -> facts.apply(s).select("c").distinct());
        jobs.put("join", s -> facts.apply(s).join(s.range(rows / 4).selectExpr("id % 5003 as b2", "id as w"),
                col("b").equalTo(col("b2"))).groupBy("a").agg(expr("sum(w)")));
        jobs.put("self_join", s -> {
            Dataset<Row> f = facts.apply(s).selectExpr("a", "b", "v");
            return f.as("x").join(f.groupBy("a").agg(expr("max(v) as m")).as("y"), "a").where("v > m / 2").groupBy("b").count();
        });
        jobs.put("range_partition", s -> facts.apply(s).repartitionByRange(16, col("c"))
                .selectExpr("spark_partition_id() as p").groupBy("p").count());
        jobs.put("window_top3", s -> facts.apply(s)
                .withColumn("rn", expr("row_number()").over(Window.partitionBy("a").orderBy(col("v").desc())))
                .where("rn <= 3"));
        jobs.put("count_distinct", s -> facts.apply(s).groupBy("a").agg(expr("count(distinct b)")));
        jobs.put("union_group", s -> facts.apply(s).select("a", "b").union(facts.apply(s).selectExpr("b % 97 as a", "a as b"))
                .groupBy("a", "b").count());
        jobs.put("two_keys_having", s -> facts.apply(s).groupBy("a", "b").agg(expr("sum(v) as total")).where("total > 100"));
        jobs.put("rollup", s -> facts.apply(s).rollup("a", "b").count());
        jobs.put("intersect", s -> facts.apply(s).select("b").intersect(s.range(rows).selectExpr("id % 2003 as b")));
        jobs.put("except", s -> facts.apply(s).select("c").except(s.range(rows / 100).selectExpr("cast(id as string) as c")));
        jobs.put("pivot", s -> facts.apply(s).selectExpr("a", "id % 4 as q", "v").groupBy("a").pivot("q").sum("v"));
        jobs.put("collect_list", s -> facts.apply(s).groupBy("a").agg(expr("size(collect_list(b)) as n")));
        jobs.put("percentile", s -> facts.apply(s).groupBy("a").agg(expr("percentile_approx(v, 0.5)")));
        jobs.put("repartition_group", s -> facts.apply(s).repartition(50).groupBy("b").agg(expr("min(c)"), expr("max(c)")));
        jobs.put("sort_merge_3way", s -> facts.apply(s).selectExpr("id % 20011 as k", "a")
                .join(s.range(rows / 2).selectExpr("id % 20011 as k", "id as y"), "k")
                .join(s.range(rows / 3).selectExpr("id % 20011 as k", "id as z"), "k")
                .groupBy("a").agg(expr("count(*)"), expr("sum(y + z)")));
        return jobs;
    }

    static String run(SparkSession spark, long rows, List<String> only) {
        Map<String, Function<SparkSession, Dataset<Row>>> jobs = jobs(rows);
        if (only != null && !jobs.keySet().containsAll(only)) {
            throw new IllegalArgumentException("unknown job in " + only + "; the jobs are " + jobs.keySet());
        }
        List<String> results = new ArrayList<>();
        long start = System.nanoTime();
        for (Map.Entry<String, Function<SparkSession, Dataset<Row>>> job : jobs.entrySet()) {
            if (only != null && !only.contains(job.getKey())) {
                continue;
            }
            long jobStart = System.nanoTime();
            Row digest = job.getValue().apply(spark)
                    .selectExpr("hash(*) as h")
                    .agg(expr("count(*)"), expr("coalesce(sum(cast(h as bigint)), 0)"))
                    .first();
            double seconds = (System.nanoTime() - jobStart) / 1e9;
            results.add(String.format("{\"name\":\"%s\",\"seconds\":%.3f,\"rows\":%d,\"digest\":%d}",
                    job.getKey(), seconds, digest.getLong(0), digest.getLong(1)));
        }
        double total = (System.nanoTime() - start) / 1e9;
        return String.format("{\"seconds\":%.3f,\"jobs\":[%s]}", total, String.join(",", results));
    }
}
