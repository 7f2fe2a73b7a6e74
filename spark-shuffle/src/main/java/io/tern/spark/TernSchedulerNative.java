package io.tern.spark;

/**
 * The JNI bridge to Tern's scheduler (spark-shuffle/src/scheduler.rs), for
 * {@link TernSchedulerBackend}: a Spark application is one Tern job whose elastic stages (one per
 * resource profile: "executors" for the default one) run one {@code spark-executor} task per Spark
 * executor. Handles and errors as in {@link TernNative}.
 */
final class TernSchedulerNative {
    private TernSchedulerNative() {}

    static {
        NativeLibrary.load(null);
    }

    /**
     * Connects to the scheduler at host:port, with the TLS material of the plugin's settings
     * (tlsDir, or all three PEM texts; empty strings: none), as {@link TernNative#connect}, acting
     * with the credential in {@code credentialFile} (a client of the application's tenant, whose
     * queue it submits to; "": a client of the default tenant).
     */
    static native long connect(String schedulerAddr, String tlsDir, String caPem, String certPem, String secretKeyPem,
            String credentialFile);

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
     * Adds the elastic stage {@code stage} to the job, with no tasks yet, each task needing
     * {@code cpuMilli}, {@code memoryBytes} and {@code gpuMilli} (another resource profile's
     * executors); a stage that exists already is left as it is. The reply as {@link #scale}'s.
     */
    static native String createStage(long client, String jobId, String stage, long cpuMilli, long memoryBytes,
            long gpuMilli, long leaseMs, String[] paramKeys, String[] paramValues, String[] envKeys,
            String[] envValues);

    /**
     * Adds {@code add} tasks to {@code stage}, cancels {@code cancel}, ends the stage when
     * {@code finish} (the job succeeds when its last stage ends), and lists the stage's tasks ended
     * from {@code endedFrom} on. The reply: "state S next N queued Q running R", "added I I ...",
     * then "ended INDEX OUTCOME MESSAGE" lines.
     */
    static native String scale(long client, String jobId, String stage, int add, int[] cancel, boolean finish,
            int endedFrom);

    /**
     * Why the application's executor tasks cannot start on the scheduler's live executors (no
     * executor fits one, or together they cannot hold the gang), or "" when they can.
     */
    static native String blocked(long client, String jobId);
}
