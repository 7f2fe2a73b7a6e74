package io.tern.spark;

import java.lang.reflect.Array;
import java.lang.reflect.Constructor;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;
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
import scala.concurrent.Future;
import scala.jdk.javaapi.CollectionConverters;
import scala.math.Ordering;

/**
 * The Spark 4 line (tern-spark-4.jar: Scala 2.13, Java 17, compiled against pyspark 4.3.0's jars,
 * serving 4.0 to 4.3): what the plugin calls differently on each Spark line, one file per line
 * (spark-shuffle/src/spark3.5 holds the other). Within 4.x the API moved twice, and this picks
 * the running shape once, by what the classes have rather than by version numbers:
 * <ul>
 *   <li>4.1 added the map output's checksum to {@code MapStatus.apply} and the row checksums to
 *       the {@code ExternalSorter} constructor (found by arity here), and
 *       {@code ShuffleDependency.rowBasedChecksums} ({@link SparkRowChecksums}, touched only
 *       where it exists);
 *   <li>4.3 requires a {@code BlockingShuffleManager}, an interface 4.0 to 4.2 lack: that is
 *       {@link TernBlockingShuffleManager}, a subclass that only 4.3 loads.
 * </ul>
 */
final class SparkLine {
    /** This jar's file name, and the Spark it serves. */
    static final String JAR = SparkVersionCheck.JAR_4;
    static final String BUILT_FOR = "Spark 4.0 to 4.3 (Scala 2.13)";
    /** The running Spark's version. */
    static final String RUNNING = org.apache.spark.package$.MODULE$.SPARK_VERSION();

    /**
     * The API shapes of the running Spark, found on first use (not when {@link #requireSupported}
     * runs, so a Spark this jar does not know gets that one line first).
     */
    private static final class Shape {
        /** The blocking-manager interface (Spark 4.3 on), or null before it. */
        static final Class<?> BLOCKING_MANAGER = classOrNull("org.apache.spark.shuffle.BlockingShuffleManager");
        /** {@code MapStatus$.apply}: 4 parameters (with the checksum, 4.1 on) or 3. */
        static final Method MAP_STATUS = method(MapStatus$.class, "apply", 4, 3);
        /** {@code ExternalSorter}'s constructor: 6 parameters (with row checksums, 4.1 on) or 5. */
        static final Constructor<?> SORTER = constructor(ExternalSorter.class, 6, 5);
        /** Whether ShuffleDependency carries row checksums (4.1 on). */
        static final boolean ROW_CHECKSUMS = hasMethod(ShuffleDependency.class, "rowBasedChecksums");
    }

    private SparkLine() {
    }

    /** Fails with one line unless this jar serves the running Spark (every entry point calls it first). */
    static void requireSupported() {
        SparkVersionCheck.require(RUNNING, JAR, BUILT_FOR);
    }

    /** The shuffle manager class for the running Spark ({@code spark.shuffle.manager}). */
    static String shuffleManagerClass() {
        return Shape.BLOCKING_MANAGER != null ? TernBlockingShuffleManager.class.getName() : TernShuffleManager.class.getName();
    }

    /** Fails with one line when the running Spark wants a blocking manager and {@code manager} is not one. */
    static void requireManagerShape(ShuffleManager manager) {
        if (Shape.BLOCKING_MANAGER != null && !Shape.BLOCKING_MANAGER.isInstance(manager)) {
            throw new IllegalStateException("Spark " + RUNNING + " needs a BlockingShuffleManager: set spark.shuffle.manager="
                    + TernBlockingShuffleManager.class.getName() + " (" + manager.getClass().getName()
                    + " serves Spark 3.5 to 4.2)");
        }
    }

    /** A map task's output status with its checksum (Spark 4.1 on; before, the checksum is dropped). */
    static MapStatus mapStatus(BlockManagerId location, long[] lengths, long mapId, long checksum) {
        Object[] args = Shape.MAP_STATUS.getParameterCount() == 4
                ? new Object[] {location, lengths, mapId, checksum}
                : new Object[] {location, lengths, mapId};
        try {
            return (MapStatus) Shape.MAP_STATUS.invoke(MapStatus$.MODULE$, args);
        } catch (IllegalAccessException e) {
            throw new IllegalStateException(e);
        } catch (InvocationTargetException e) {
            throw rethrow(e);
        }
    }

    /** The row checksums Spark asks the map task for, or null where it asks none. */
    static RowChecksums rowChecksums(ShuffleDependency<?, ?, ?> dependency) {
        return Shape.ROW_CHECKSUMS ? SparkRowChecksums.of(dependency) : null;
    }

    /** A spilling sorter by key ordering alone (no aggregation, no partitioning), as Spark's reader makes. */
    @SuppressWarnings("unchecked")
    static <K, C> ExternalSorter<K, C, C> sorter(TaskContext context, Option<Ordering<K>> ordering, Serializer serializer) {
        Object[] args = Shape.SORTER.getParameterCount() == 6
                // No row checksums: a reader's sorter writes no shuffle output.
                ? new Object[] {context, Option.empty(), Option.empty(), ordering, serializer,
                    Array.newInstance(Shape.SORTER.getParameterTypes()[5].getComponentType(), 0)}
                : new Object[] {context, Option.empty(), Option.empty(), ordering, serializer};
        try {
            return (ExternalSorter<K, C, C>) Shape.SORTER.newInstance(args);
        } catch (InstantiationException | IllegalAccessException e) {
            throw new IllegalStateException(e);
        } catch (InvocationTargetException e) {
            throw rethrow(e);
        }
    }

    /** Spark's coarse-grained backend with the kill call in Java types (Scala 2.13's {@code immutable.Seq}). */
    abstract static class CoarseGrainedBackend extends CoarseGrainedSchedulerBackend {
        CoarseGrainedBackend(TaskSchedulerImpl scheduler, RpcEnv rpcEnv) {
            super(scheduler, rpcEnv);
        }

        @Override
        public final Future<Object> doKillExecutors(scala.collection.immutable.Seq<String> ids) {
            return killExecutors(CollectionConverters.asJava(ids));
        }

        /** Kills the executors Spark names (CoarseGrainedSchedulerBackend#doKillExecutors). */
        abstract Future<Object> killExecutors(List<String> ids);
    }

    private static Class<?> classOrNull(String name) {
        try {
            return Class.forName(name, false, SparkLine.class.getClassLoader());
        } catch (ClassNotFoundException e) {
            return null;
        }
    }

    private static boolean hasMethod(Class<?> owner, String name) {
        for (Method m : owner.getMethods()) {
            if (m.getName().equals(name)) {
                return true;
            }
        }
        return false;
    }

    /** The public method {@code name} of {@code owner} with the first parameter count of {@code counts} it has. */
    private static Method method(Class<?> owner, String name, int... counts) {
        for (int count : counts) {
            for (Method m : owner.getMethods()) {
                if (m.getName().equals(name) && m.getParameterCount() == count) {
                    return m;
                }
            }
        }
        throw new IllegalStateException(JAR + " does not know Spark " + RUNNING + "'s " + owner.getName() + "." + name);
    }

    /** The public constructor of {@code owner} with the first parameter count of {@code counts} it has. */
    private static Constructor<?> constructor(Class<?> owner, int... counts) {
        for (int count : counts) {
            for (Constructor<?> c : owner.getConstructors()) {
                if (c.getParameterCount() == count) {
                    return c;
                }
            }
        }
        throw new IllegalStateException(JAR + " does not know Spark " + RUNNING + "'s " + owner.getName() + " constructor");
    }

    /** The exception a reflective call threw, unwrapped (checked ones thrown as they are). */
    private static RuntimeException rethrow(InvocationTargetException e) {
        return SparkLine.<RuntimeException>sneaky(e.getCause());
    }

    @SuppressWarnings("unchecked")
    private static <E extends Throwable> E sneaky(Throwable e) throws E {
        throw (E) e;
    }
}
