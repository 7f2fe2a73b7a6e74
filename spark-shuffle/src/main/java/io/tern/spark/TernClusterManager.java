package io.tern.spark;

import org.apache.spark.SparkContext;
import org.apache.spark.scheduler.ExternalClusterManager;
import org.apache.spark.scheduler.SchedulerBackend;
import org.apache.spark.scheduler.TaskScheduler;
import org.apache.spark.scheduler.TaskSchedulerImpl;

/**
 * Spark applications on Tern's scheduler: the master URL {@code tern://HOST:PORT} (the scheduler's
 * address) or its one alias {@code local-cluster-tern://HOST:PORT}, the form to use. The alias is
 * spelt so for two checks in Spark 3.5: spark-submit (and so pyspark) takes only masters starting
 * yarn, spark, mesos, k8s or local, so it refuses {@code tern://}; and ResourceProfileManager
 * allows resource profiles other than the default (stage-level scheduling, with dynamic
 * allocation) only on YARN, Kubernetes and masters starting {@code spark://} or
 * {@code local-cluster}. Spark's own local-cluster master is the full pattern
 * {@code local-cluster[N,C,M]}, which this URL does not match, so SparkContext hands it to the
 * external cluster managers. (Under such a master Spark's default profile names no executor cores
 * unless spark.executor.cores is set; {@link TernSchedulerBackend} then takes 1, that key's
 * default.) Found by Spark through META-INF/services; the executors are Tern tasks
 * ({@link TernSchedulerBackend}).
 */
public final class TernClusterManager implements ExternalClusterManager {
    static final String SCHEME = "tern://";
    static final String ALIAS = "local-cluster-tern://";

    @Override
    public boolean canCreate(String masterUrl) {
        return masterUrl.startsWith(SCHEME) || masterUrl.startsWith(ALIAS);
    }

    @Override
    public TaskScheduler createTaskScheduler(SparkContext sc, String masterUrl) {
        SparkLine.requireSupported();
        return new TaskSchedulerImpl(sc);
    }

    @Override
    public SchedulerBackend createSchedulerBackend(SparkContext sc, String masterUrl, TaskScheduler scheduler) {
        return new TernSchedulerBackend((TaskSchedulerImpl) scheduler, sc, schedulerAddress(masterUrl));
    }

    @Override
    public void initialize(TaskScheduler scheduler, SchedulerBackend backend) {
        ((TaskSchedulerImpl) scheduler).initialize(backend);
    }

    /** HOST:PORT of the URL, checked. */
    static String schedulerAddress(String masterUrl) {
        String rest = masterUrl.startsWith(ALIAS) ? masterUrl.substring(ALIAS.length())
                : masterUrl.substring(SCHEME.length());
        int colon = rest.lastIndexOf(':');
        boolean ok = colon > 0 && colon < rest.length() - 1 && !rest.contains("/");
        if (ok) {
            try {
                int port = Integer.parseInt(rest.substring(colon + 1));
                ok = port > 0 && port < 65536;
            } catch (NumberFormatException e) {
                ok = false;
            }
        }
        if (!ok) {
            throw new IllegalArgumentException("master URL " + masterUrl + ": expected " + SCHEME
                    + "HOST:PORT or " + ALIAS + "HOST:PORT with the Tern scheduler's address");
        }
        return rest;
    }
}
