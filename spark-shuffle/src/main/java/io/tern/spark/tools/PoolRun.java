package io.tern.spark.tools;

import java.lang.management.ManagementFactory;
import java.util.ArrayList;
import java.util.Collections;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;

import org.apache.spark.SparkConf;
import org.apache.spark.SparkEnv;
import org.apache.spark.api.java.JavaSparkContext;
import org.apache.spark.scheduler.SparkListener;
import org.apache.spark.scheduler.SparkListenerApplicationStart;
import org.apache.spark.scheduler.SparkListenerExecutorAdded;

import io.tern.spark.TernSchedulerBackend;
import io.tern.spark.WarmExecutor;
import scala.Tuple2;

/**
 * One run of {@code tern bench spark-pool}: how long the application's executors took to come, then
 * a TeraSort on them. {@code spark-submit --conf spark.extraListeners=io.tern.spark.tools.PoolRun$Times
 * --class io.tern.spark.tools.PoolRun JAR EXECUTORS IN OUT PARTITIONS} waits for EXECUTORS executors,
 * asks each (a task on it) when its JVM started, sorts IN into OUT as {@link TeraSort} does, and
 * prints one line {@code POOLRUN {json}}: per executor the time its Tern task was asked of the
 * scheduler (on Tern's scheduler; -1 on others), the application's start (Spark's
 * SparkListenerApplicationStart, after its cluster manager started), the executor JVM's start
 * (its RuntimeMXBean; for an executor that was a parked JVM, its hand-off, and {@code "warm":true})
 * and its registration with the driver, all ms since the epoch on one
 * machine's clock; and the TeraSort's result.
 */
public final class PoolRun {
    /** Longest wait for the executors. */
    private static final long EXECUTORS_WAIT_MS = 180_000;

    private PoolRun() {}

    /** Registration times by executor id, and the application's start, as Spark's listener bus posts them. */
    public static final class Times extends SparkListener {
        static final Map<String, Long> REGISTERED = new ConcurrentHashMap<>();
        static volatile long applicationStart = -1;

        @Override
        public void onApplicationStart(SparkListenerApplicationStart start) {
            applicationStart = start.time();
        }

        @Override
        public void onExecutorAdded(SparkListenerExecutorAdded added) {
            REGISTERED.putIfAbsent(added.executorId(), added.time());
        }
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 4) {
            System.err.println("usage: PoolRun EXECUTORS IN_DIR OUT_DIR PARTITIONS");
            System.exit(2);
        }
        int executors = Integer.parseInt(args[0]);
        SparkConf conf = new SparkConf().setAppName("tern-spark-pool");
        try (JavaSparkContext jsc = new JavaSparkContext(conf)) {
            long deadline = System.currentTimeMillis() + EXECUTORS_WAIT_MS;
            while (Times.REGISTERED.size() < executors) {
                if (System.currentTimeMillis() > deadline) {
                    throw new IllegalStateException(Times.REGISTERED.size() + " of " + executors
                            + " executors registered within " + EXECUTORS_WAIT_MS + " ms");
                }
                Thread.sleep(20);
            }
            Map<String, ExecutorStart> started = executorStarts(jsc, executors);
            Object backend = jsc.sc().schedulerBackend();
            StringBuilder json = new StringBuilder("{\"application_start_ms\":" + Times.applicationStart
                    + ",\"executors\":[");
            List<String> ids = new ArrayList<>(Times.REGISTERED.keySet());
            Collections.sort(ids);
            for (int i = 0; i < ids.size(); i++) {
                String id = ids.get(i);
                long requested = backend instanceof TernSchedulerBackend
                        ? ((TernSchedulerBackend) backend).requestedAtMs(id) : -1;
                json.append(i == 0 ? "" : ",").append("{\"id\":\"").append(id).append("\",\"requested_ms\":")
                        .append(requested).append(started.getOrDefault(id, ExecutorStart.UNKNOWN).json())
                        .append(",\"registered_ms\":").append(Times.REGISTERED.get(id)).append('}');
            }
            json.append("],\"terasort\":")
                    .append(TeraSort.run(jsc, args[1], args[2], Integer.parseInt(args[3]))).append('}');
            System.out.println("POOLRUN " + json);
        }
    }

    /** When an executor started: its JVM's start, or a warm JVM's hand-off. */
    static final class ExecutorStart implements java.io.Serializable {
        static final ExecutorStart UNKNOWN = new ExecutorStart(-1, false);
        final long ms;
        final boolean warm;

        ExecutorStart(long ms, boolean warm) {
            this.ms = ms;
            this.warm = warm;
        }

        /** This executor's. */
        static ExecutorStart here() {
            long handoff = Long.getLong(WarmExecutor.HANDOFF_PROPERTY, -1L);
            return handoff > 0 ? new ExecutorStart(handoff, true)
                    : new ExecutorStart(ManagementFactory.getRuntimeMXBean().getStartTime(), false);
        }

        String json() {
            return ",\"jvm_start_ms\":" + ms + ",\"warm\":" + warm;
        }
    }

    /** Each executor's start, from tasks spread until every executor ran one. */
    private static Map<String, ExecutorStart> executorStarts(JavaSparkContext jsc, int executors)
            throws InterruptedException {
        Map<String, ExecutorStart> starts = new HashMap<>();
        for (int round = 0; round < 20 && starts.size() < executors; round++) {
            List<Integer> slices = new ArrayList<>();
            for (int i = 0; i < 8 * executors; i++) {
                slices.add(i);
            }
            for (Tuple2<String, ExecutorStart> seen : jsc.parallelize(slices, slices.size()).map(i -> {
                // Long enough that every executor gets a task before one runs them all.
                Thread.sleep(50);
                return new Tuple2<>(SparkEnv.get().executorId(), ExecutorStart.here());
            }).collect()) {
                starts.put(seen._1(), seen._2());
            }
        }
        return starts;
    }
}
