package io.tern.spark.tools;

import java.lang.management.ManagementFactory;
import java.util.HashMap;
import java.util.Iterator;
import java.util.List;
import java.util.Map;

import org.apache.spark.SparkEnv;
import org.apache.spark.TaskContext;
import org.apache.spark.util.CollectionAccumulator;

/**
 * The process CPU an executor spends on one stage, all threads included. Each task of the stage
 * records its executor's process CPU clock when it starts reading its input and again when it
 * completes (after its shuffle writer committed); per executor, the stage's CPU is the last end
 * minus the first start. Between those, an executor runs only this stage's tasks (a stage's
 * shuffle output is read only after the whole stage ends), so nothing else is counted but the
 * JVM's own background work, which both shuffles pay alike.
 */
public final class ProcessCpu {
    private ProcessCpu() {}

    /** This process's CPU time (user + system, every thread) in nanoseconds. */
    public static long now() {
        java.lang.management.OperatingSystemMXBean os = ManagementFactory.getOperatingSystemMXBean();
        if (os instanceof com.sun.management.OperatingSystemMXBean) {
            return ((com.sun.management.OperatingSystemMXBean) os).getProcessCpuTime();
        }
        throw new IllegalStateException("this JVM does not report process CPU time");
    }

    /** Passes {@code input} through, recording "executor,startNs,endNs" for this task on completion. */
    public static <T> Iterator<T> measured(CollectionAccumulator<String> samples, Iterator<T> input) {
        long start = now();
        String executor = SparkEnv.get().executorId();
        TaskContext.get().addTaskCompletionListener(
                (org.apache.spark.util.TaskCompletionListener) ctx -> samples.add(executor + "," + start + "," + now()));
        return input;
    }

    /** Sum over executors of (last end - first start), from the samples {@link #measured} recorded. */
    public static long total(List<String> samples) {
        Map<String, long[]> spans = new HashMap<>();
        for (String sample : samples) {
            String[] f = sample.split(",");
            long start = Long.parseLong(f[1]);
            long end = Long.parseLong(f[2]);
            spans.merge(f[0], new long[] {start, end},
                    (a, b) -> new long[] {Math.min(a[0], b[0]), Math.max(a[1], b[1])});
        }
        return spans.values().stream().mapToLong(s -> s[1] - s[0]).sum();
    }
}
