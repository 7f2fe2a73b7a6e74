package io.tern.spark.tools;

import java.lang.reflect.Method;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Random;
import java.util.stream.Collectors;
import java.util.stream.IntStream;

import org.apache.spark.MapOutputTrackerMaster;
import org.apache.spark.SparkEnv;
import org.apache.spark.api.java.JavaPairRDD;
import org.apache.spark.api.java.JavaSparkContext;
import org.apache.spark.scheduler.MapStatus;
import org.apache.spark.shuffle.ShuffleManager;

import scala.Tuple2;

/**
 * Shuffles that run the JVM's own aggregation and ordering paths (PySpark's RDD API combines and
 * sorts in Python, so it does not reach them). Each returns a canonical string of its result, for
 * the test suite to compare between Spark's built-in shuffle and Tern's. Also what the suite reads
 * of the driver's SparkEnv, which Py4J cannot reach on Spark 4.3 ({@link #shuffleManager}).
 */
public final class JvmCases {
    private JvmCases() {}

    private static JavaPairRDD<Integer, Long> numbers(JavaSparkContext jsc, int n, int modulo) {
        List<Integer> data = IntStream.range(0, n).boxed().collect(Collectors.toList());
        return jsc.parallelize(data, 4).mapToPair(x -> new Tuple2<>(x % modulo, (long) x));
    }

    /** Map-side combine (aggregator with mapSideCombine). */
    public static String reduceByKey(JavaSparkContext jsc) {
        List<Tuple2<Integer, Long>> out = new ArrayList<>(numbers(jsc, 200_000, 1009).reduceByKey(Long::sum, 7).collect());
        out.sort((a, b) -> Integer.compare(a._1(), b._1()));
        return out.toString();
    }

    /** Aggregation on the read side only (no map-side combine). */
    public static String groupByKey(JavaSparkContext jsc) {
        List<Tuple2<Integer, List<Long>>> out = new ArrayList<>(numbers(jsc, 100_000, 97)
                .groupByKey(5)
                .mapValues(values -> {
                    List<Long> sorted = new ArrayList<>();
                    values.forEach(sorted::add);
                    Collections.sort(sorted);
                    return sorted;
                })
                .collect());
        out.sort((a, b) -> Integer.compare(a._1(), b._1()));
        return out.toString();
    }

    /** Key ordering on the read side (ExternalSorter); the result's order is the test. */
    public static String sortByKey(JavaSparkContext jsc) {
        List<Integer> keys = IntStream.range(0, 100_000).boxed().collect(Collectors.toList());
        Collections.shuffle(keys, new Random(42));
        return jsc.parallelize(keys, 4)
                .mapToPair(x -> new Tuple2<>(x, (long) x * 3))
                .sortByKey(true, 6)
                .collect()
                .toString();
    }

    /** A map range and partition range read: the shuffle read by a coalesced, then filtered job. */
    public static String aggregateByKey(JavaSparkContext jsc) {
        List<Tuple2<Integer, Long>> out = new ArrayList<>(numbers(jsc, 100_000, 13)
                .aggregateByKey(0L, 3, (acc, v) -> acc + v * v, Long::sum)
                .collect());
        out.sort((a, b) -> Integer.compare(a._1(), b._1()));
        return out.toString();
    }

    /**
     * This JVM's shuffle manager, for the suite. Py4J cannot call SparkEnv's own methods on Spark
     * 4.3: it reflects on all of SparkEnv's methods, one of which names a class of a jar pyspark
     * does not ship (com.google.protobuf), and the call dies with NoClassDefFoundError.
     */
    public static ShuffleManager shuffleManager() {
        return SparkEnv.get().shuffleManager();
    }

    /** The class of this JVM's shuffle manager (see {@link #shuffleManager}). */
    public static String shuffleManagerClass() {
        return shuffleManager().getClass().getName();
    }

    /**
     * Spark 4.1 on: the order-independent checksum each map of the driver's newest shuffle
     * reported ({@code MapStatus.checksumValue}, by reflection so this compiles for Spark 3.5 too),
     * by map index.
     */
    public static long[] newestShuffleChecksums() throws ReflectiveOperationException {
        MapOutputTrackerMaster tracker = (MapOutputTrackerMaster) SparkEnv.get().mapOutputTracker();
        int newest = -1;
        scala.collection.Iterator<Object> ids = tracker.shuffleStatuses().keysIterator();
        while (ids.hasNext()) {
            newest = Math.max(newest, (Integer) ids.next());
        }
        MapStatus[] statuses = tracker.shuffleStatuses().get(newest).get().mapStatuses();
        Method checksum = MapStatus.class.getMethod("checksumValue");
        long[] out = new long[statuses.length];
        for (int i = 0; i < statuses.length; i++) {
            out[i] = (Long) checksum.invoke(statuses[i]);
        }
        return out;
    }
}
