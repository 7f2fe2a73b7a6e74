package io.tern.spark;

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.List;

import org.apache.spark.executor.CoarseGrainedExecutorBackend;

/**
 * A parked Spark executor JVM, started by a Tern executor before any Spark application asks for it
 * (the {@code spark-executor} operator's warm JVMs): it loads and initializes the classes a Spark
 * executor of its kind loaded on its way to its first task (the class list the Tern executor
 * learned from such an executor's {@code -Xlog:class+load}), says so on stdout, then waits on
 * stdin for the one line that makes it an executor. Starting the JVM and loading Spark's classes
 * is most of an executor's start (seconds); what is left after the hand-off is Spark's own
 * registration with the driver.
 *
 * <p>Arguments: the class list file (one binary class name a line; absent or empty: nothing to
 * load). The hand-off line: NUL-separated fields; {@code -Dkey=value} fields become system
 * properties (the application's own startup settings, such as {@code spark.driver.port}, which
 * a JVM started before the application cannot have on its command line), the rest are
 * {@link CoarseGrainedExecutorBackend}'s arguments. End of input before a line (the Tern executor
 * stopped or gave the JVM up) exits quietly.
 *
 * <p>A class whose static initializer throws stays unusable in this JVM for good, so a JVM where
 * one did is no executor: it exits with status {@link #POISONED}, naming the classes, and is
 * never handed an application. Classes that are missing (a dependency absent here, as a cold
 * executor would find too) only count.
 */
public final class WarmExecutor {
    /** Printed on stdout (with counts) once the classes are in. */
    static final String READY = "TERN-WARM-READY";
    /** Exit status of a JVM where a class failed to initialize. */
    static final int POISONED = 3;
    /** Set at the hand-off (ms since the epoch): when this JVM became an executor. */
    public static final String HANDOFF_PROPERTY = "tern.executor.handoffMs";

    private WarmExecutor() {
    }

    /**
     * What every executor does before it registers whose cost is not class loading, done once per
     * JVM either way: Hadoop's configuration and login (SparkHadoopUtil.runAsSparkUser, about a
     * second cold), and the plugin's native library (unpacked into Spark's first local directory,
     * as {@link TernConf#nativeDir} would choose without {@code spark.tern.nativeDir}). Both come
     * out the same as in a cold executor: they read only this JVM's options and environment, which
     * a parked JVM shares with the executors it may become. A failure here is left for the
     * executor to meet (a library that will not load here is loaded from the application's
     * directory then).
     */
    private static void warmSingletons() {
        try {
            org.apache.spark.deploy.SparkHadoopUtil.get();
            org.apache.hadoop.security.UserGroupInformation.getCurrentUser();
        } catch (Exception | LinkageError e) {
            System.err.println("warm-up: Hadoop's login: " + e);
        }
        try {
            String localDirs = System.getenv("SPARK_LOCAL_DIRS");
            NativeLibrary.load(localDirs == null || localDirs.isEmpty() ? null : localDirs.split(",")[0]);
        } catch (RuntimeException | LinkageError e) {
            System.err.println("warm-up: the native library: " + e);
        }
    }

    public static void main(String[] argv) throws Exception {
        long started = System.nanoTime();
        int loaded = 0;
        int missing = 0;
        List<String> poisoned = new ArrayList<>();
        if (argv.length > 0 && !argv[0].isEmpty()) {
            ClassLoader loader = WarmExecutor.class.getClassLoader();
            for (String name : Files.readAllLines(Paths.get(argv[0]), StandardCharsets.UTF_8)) {
                if (name.isEmpty()) {
                    continue;
                }
                try {
                    Class.forName(name, true, loader);
                    loaded++;
                } catch (ExceptionInInitializerError e) {
                    poisoned.add(name + " (" + e.getCause() + ")");
                } catch (LinkageError | ClassNotFoundException e) {
                    missing++;
                }
            }
        }
        warmSingletons();
        if (!poisoned.isEmpty()) {
            System.err.println("a warm executor JVM is unusable: static initializers failed in " + poisoned);
            System.exit(POISONED);
        }
        System.out.println(READY + " loaded=" + loaded + " missing=" + missing + " ms="
                + (System.nanoTime() - started) / 1_000_000);
        System.out.flush();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line = in.readLine();
        if (line == null) {
            System.exit(0);
        }
        System.setProperty(HANDOFF_PROPERTY, Long.toString(System.currentTimeMillis()));
        List<String> args = new ArrayList<>();
        for (String field : line.split("\0")) {
            int eq = field.indexOf('=');
            if (field.startsWith("-D") && eq > 2) {
                System.setProperty(field.substring(2, eq), field.substring(eq + 1));
            } else if (!field.isEmpty()) {
                args.add(field);
            }
        }
        CoarseGrainedExecutorBackend.main(args.toArray(new String[0]));
    }
}
