package io.tern.spark;

import java.util.List;

import org.apache.spark.ShuffleDependency;
import org.apache.spark.TaskContext;
import org.apache.spark.rpc.RpcEnv;
import org.apache.spark.scheduler.MapStatus;
import org.apache.spark.scheduler.MapStatus$;
import org.apache.spark.scheduler.TaskSchedulerImpl;
import org.apache.spark.scheduler.cluster.CoarseGrainedSchedulerBackend;
import org.apache.spark.serializer.Serializer;
import org.apache.spark.shuffle.ShuffleManager;
import org.apache.spark.storage.BlockManagerId;
import org.apache.spark.util.collection.ExternalSorter;

import scala.Option;
import scala.collection.JavaConverters;
import scala.concurrent.Future;
import scala.math.Ordering;

/**
 * The Spark 3.5 line (tern-spark-3.5.jar: Scala 2.12, compiled with {@code --release 8} against
 * pyspark 3.5.3's jars): what the plugin calls differently on each Spark line, one file per line
 * (spark-shuffle/src/spark4 holds the other). Spark 3.5 has no order-independent shuffle
 * checksums, a three-argument {@code MapStatus.apply}, a five-argument {@code ExternalSorter} and
 * Scala 2.12 collections.
 */
final class SparkLine {
    /** This jar's file name, and the Spark it serves. */
    static final String JAR = SparkVersionCheck.JAR_35;
    static final String BUILT_FOR = "Spark 3.5 (Scala 2.12)";
    /** The running Spark's version. */
    static final String RUNNING = org.apache.spark.package$.MODULE$.SPARK_VERSION();

    private SparkLine() {
    }

    /** Fails with one line unless this jar serves the running Spark (every entry point calls it first). */
    static void requireSupported() {
        SparkVersionCheck.require(RUNNING, JAR, BUILT_FOR);
    }

    /** The shuffle manager class for the running Spark ({@code spark.shuffle.manager}). */
    static String shuffleManagerClass() {
        return TernShuffleManager.class.getName();
    }

    /** Spark 3.5 takes any ShuffleManager. */
    static void requireManagerShape(ShuffleManager manager) {
    }

    /** A map task's output status; Spark 3.5 has no checksum to carry ({@code checksum} is unused). */
    static MapStatus mapStatus(BlockManagerId location, long[] lengths, long mapId, long checksum) {
        return MapStatus$.MODULE$.apply(location, lengths, mapId);
    }

    /** Spark 3.5 asks for no row checksums. */
    static RowChecksums rowChecksums(ShuffleDependency<?, ?, ?> dependency) {
        return null;
    }

    /** A spilling sorter by key ordering alone (no aggregation, no partitioning), as Spark's reader makes. */
    static <K, C> ExternalSorter<K, C, C> sorter(TaskContext context, Option<Ordering<K>> ordering, Serializer serializer) {
        return new ExternalSorter<>(context, Option.empty(), Option.empty(), ordering, serializer);
    }

    /** Spark's coarse-grained backend with the kill call in Java types (Scala 2.12's {@code collection.Seq}). */
    abstract static class CoarseGrainedBackend extends CoarseGrainedSchedulerBackend {
        CoarseGrainedBackend(TaskSchedulerImpl scheduler, RpcEnv rpcEnv) {
            super(scheduler, rpcEnv);
        }

        @Override
        public final Future<Object> doKillExecutors(scala.collection.Seq<String> ids) {
            return killExecutors(JavaConverters.seqAsJavaListConverter(ids).asJava());
        }

        /** Kills the executors Spark names (CoarseGrainedSchedulerBackend#doKillExecutors). */
        abstract Future<Object> killExecutors(List<String> ids);
    }
}
