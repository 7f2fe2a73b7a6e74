package io.tern.spark;

/**
 * The JNI bridge to Tern's scheduler (spark-shuffle/src/scheduler.rs), for
 * {@link TernSchedulerBackend}: a Spark application is one Tern job whose elastic stage
 * "executors" runs one {@code spark-executor} task per Spark executor. Handles and errors as in
 * {@link TernNative}.
 */
final class TernSchedulerNative {
    private TernSchedulerNative() {}

    static {
        NativeLibrary.load(null);
    }

    /**
     * Connects to the scheduler at host:port, with the TLS material of the plugin's settings
     * (tlsDir, or all three PEM texts; empty strings: none), as {@link TernNative#connect}.
     */
    static native long connect(String schedulerAddr, String tlsDir, String caPem, String certPem, String secretKeyPem);

    static native void closeScheduler(long client);

    /**
     * Submits the application's job; returns three lines: its id, its Tern job's id and that Tern
     * job's token (the application's shuffles go there). The scheduler cancels it when no
     * {@link #scale} call comes for {@code leaseMs} (the driver died).
     */
    static native String submit(long client, String name, String queue, int priority, long cpuMilli,
            long memoryBytes, long gpuMilli, int initial, int minAvailable, long leaseMs, String[] paramKeys,
            String[] paramValues, String[] envKeys, String[] envValues);

    /**
     * Adds {@code add} executor tasks, cancels {@code cancel}, ends the job when {@code finish},
     * and lists tasks ended from {@code endedFrom} on. The reply: "state S next N queued Q running R",
     * "added I I ...", then "ended INDEX OUTCOME MESSAGE" lines.
     */
    static native String scale(long client, String jobId, int add, int[] cancel, boolean finish, int endedFrom);

    /**
     * Why the application's executor tasks cannot start on the scheduler's live executors (no
     * executor fits one, or together they cannot hold the gang), or "" when they can.
     */
    static native String blocked(long client, String jobId);
}
