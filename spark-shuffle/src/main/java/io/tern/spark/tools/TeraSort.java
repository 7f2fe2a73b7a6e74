package io.tern.spark.tools;

import java.io.BufferedOutputStream;
import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.OutputStream;
import java.io.Serializable;
import java.util.Arrays;
import java.util.Collections;
import java.util.Comparator;
import java.util.Iterator;
import java.util.concurrent.atomic.AtomicLong;

import org.apache.spark.Partitioner;
import org.apache.spark.SparkConf;
import org.apache.spark.api.java.JavaSparkContext;
import org.apache.spark.scheduler.SparkListener;
import org.apache.spark.scheduler.SparkListenerTaskEnd;
import org.apache.spark.executor.TaskMetrics;
import org.apache.spark.util.CollectionAccumulator;

import scala.Tuple2;

/**
 * TeraSort on Spark: gensort records (100 bytes: 10-byte key, 90-byte value) from a local
 * directory, range-partitioned on the key's first two bytes (gensort keys are uniform), sorted
 * within each partition by Spark's shuffle read (ExternalSorter), written as part-NNNNN files in
 * key order, so {@code tern teravalidate --local OUT} checks them as valsort would.
 *
 * <p>{@code spark-submit --class io.tern.spark.tools.TeraSort JAR IN OUT PARTITIONS} prints one
 * line {@code TERASORT {json}} with the time and the map tasks' CPU and shuffle bytes.
 *
 * <p>{@code map_process_cpu_ns} is the CPU time of the executor processes (every thread: the task
 * thread, GC, JIT and native threads such as Tern's pushes) over the map stage, from each
 * executor's process CPU clock at its first map task's start and its last map task's end (see
 * {@link ProcessCpu}); {@code map_cpu_ns} is Spark's executorCpuTime, the task threads only.
 */
public final class TeraSort {
    private TeraSort() {}

    public static void main(String[] args) throws Exception {
        if (args.length != 3) {
            System.err.println("usage: TeraSort IN_DIR OUT_DIR PARTITIONS");
            System.exit(2);
        }
        SparkConf conf = new SparkConf().setAppName("tern-terasort");
        try (JavaSparkContext jsc = new JavaSparkContext(conf)) {
            System.out.println("TERASORT " + run(jsc, args[0], args[1], Integer.parseInt(args[2])));
        }
    }

    /** Sorts IN into OUT; returns {"seconds", "records", "map_cpu_ns", "shuffle_bytes_written", ...}. */
    public static String run(JavaSparkContext jsc, String in, String out, int partitions) throws Exception {
        File outDir = new File(out);
        outDir.mkdirs();
        Metrics metrics = new Metrics();
        jsc.sc().addSparkListener(metrics);
        long start = System.nanoTime();
        CollectionAccumulator<String> mapCpu = jsc.sc().collectionAccumulator("tern-terasort-map-process-cpu");
        long records = jsc.binaryRecords(in, 100)
                .mapPartitions(it -> ProcessCpu.measured(mapCpu, it), true)
                .mapToPair(r -> new Tuple2<>(Arrays.copyOfRange(r, 0, 10), Arrays.copyOfRange(r, 10, 100)))
                .repartitionAndSortWithinPartitions(new PrefixPartitioner(partitions), new KeyOrder())
                .mapPartitionsWithIndex((index, it) -> Collections.singletonList(writePart(out, index, it)).iterator(), true)
                .collect()
                .stream()
                .mapToLong(Long::longValue)
                .sum();
        double seconds = (System.nanoTime() - start) / 1e9;
        jsc.sc().listenerBus().waitUntilEmpty();
        jsc.sc().removeSparkListener(metrics);
        return String.format(
                "{\"seconds\":%.3f,\"records\":%d,\"map_process_cpu_ns\":%d,\"map_cpu_ns\":%d,\"map_run_ns\":%d,\"shuffle_bytes_written\":%d,"
                        + "\"shuffle_records_written\":%d,\"reduce_cpu_ns\":%d,\"shuffle_bytes_read\":%d}",
                seconds, records, ProcessCpu.total(mapCpu.value()), metrics.mapCpu.get(), metrics.mapRun.get(), metrics.bytesWritten.get(),
                metrics.recordsWritten.get(), metrics.reduceCpu.get(), metrics.bytesRead.get());
    }

    private static long writePart(String out, int index, Iterator<Tuple2<byte[], byte[]>> records) throws IOException {
        long count = 0;
        File part = new File(out, String.format("part-%05d", index));
        try (OutputStream os = new BufferedOutputStream(new FileOutputStream(part), 1 << 20)) {
            while (records.hasNext()) {
                Tuple2<byte[], byte[]> r = records.next();
                os.write(r._1());
                os.write(r._2());
                count++;
            }
        }
        return count;
    }

    /** Partition = the key's first two bytes scaled to the partition count: monotone in the key. */
    public static final class PrefixPartitioner extends Partitioner {
        private static final long serialVersionUID = 1L;
        private final int partitions;

        public PrefixPartitioner(int partitions) {
            this.partitions = partitions;
        }

        @Override
        public int numPartitions() {
            return partitions;
        }

        @Override
        public int getPartition(Object key) {
            byte[] k = (byte[]) key;
            int prefix = ((k[0] & 0xff) << 8) | (k[1] & 0xff);
            return (int) (((long) prefix * partitions) >>> 16);
        }

        @Override
        public boolean equals(Object o) {
            return o instanceof PrefixPartitioner && ((PrefixPartitioner) o).partitions == partitions;
        }

        @Override
        public int hashCode() {
            return partitions;
        }
    }

    /** memcmp order of keys, as valsort checks it. */
    public static final class KeyOrder implements Comparator<byte[]>, Serializable {
        private static final long serialVersionUID = 1L;

        @Override
        public int compare(byte[] a, byte[] b) {
            int n = Math.min(a.length, b.length);
            for (int i = 0; i < n; i++) {
                int d = (a[i] & 0xff) - (b[i] & 0xff);
                if (d != 0) {
                    return d;
                }
            }
            return a.length - b.length;
        }
    }

    /** Sums task metrics: map tasks (shuffle writers) and reduce tasks (shuffle readers). */
    static final class Metrics extends SparkListener {
        final AtomicLong mapCpu = new AtomicLong();
        final AtomicLong mapRun = new AtomicLong();
        final AtomicLong bytesWritten = new AtomicLong();
        final AtomicLong recordsWritten = new AtomicLong();
        final AtomicLong reduceCpu = new AtomicLong();
        final AtomicLong bytesRead = new AtomicLong();

        @Override
        public void onTaskEnd(SparkListenerTaskEnd end) {
            TaskMetrics m = end.taskMetrics();
            if (m == null) {
                return;
            }
            if (m.shuffleWriteMetrics().bytesWritten() > 0) {
                mapCpu.addAndGet(m.executorCpuTime());
                mapRun.addAndGet(m.executorRunTime() * 1_000_000L);
                bytesWritten.addAndGet(m.shuffleWriteMetrics().bytesWritten());
                recordsWritten.addAndGet(m.shuffleWriteMetrics().recordsWritten());
            } else {
                reduceCpu.addAndGet(m.executorCpuTime());
                bytesRead.addAndGet(m.shuffleReadMetrics().totalBytesRead());
            }
        }
    }
}
