package io.tern.spark;

/**
 * Which plugin jar serves which Spark: each jar's {@link SparkLine} says what it was built for, and
 * every entry point Spark calls (the shuffle manager, the shuffle I/O plugin, the cluster manager,
 * a warm executor) checks the running Spark first, so a jar on the wrong Spark fails at start-up
 * with one line naming the version found and the jar to use, never with a NoSuchMethodError deep
 * in a task.
 */
final class SparkVersionCheck {
    /** The jar for Spark 3.5 (Scala 2.12, Java 8+). */
    static final String JAR_35 = "tern-spark-3.5.jar";
    /** The jar for Spark 4.0 to 4.3 (Scala 2.13, Java 17+). */
    static final String JAR_4 = "tern-spark-4.jar";

    private SparkVersionCheck() {
    }

    /** [major, minor] of a Spark version such as "4.3.0" or "3.5.3-SNAPSHOT"; [-1, -1] if unreadable. */
    static int[] majorMinor(String version) {
        String[] parts = version.split("[.-]");
        try {
            return new int[] {Integer.parseInt(parts[0]), Integer.parseInt(parts[1])};
        } catch (RuntimeException e) {
            return new int[] {-1, -1};
        }
    }

    /** The plugin jar for Spark {@code version}, or null when no jar serves it. */
    static String jarFor(String version) {
        int[] v = majorMinor(version);
        if (v[0] == 3 && v[1] == 5) {
            return JAR_35;
        }
        if (v[0] == 4 && v[1] >= 0 && v[1] <= 3) {
            return JAR_4;
        }
        return null;
    }

    /**
     * Throws unless {@code jar} (this jar) serves Spark {@code running}; {@code builtFor} says
     * what it was built for.
     */
    static void require(String running, String jar, String builtFor) {
        if (jar.equals(jarFor(running))) {
            return;
        }
        String other = jarFor(running);
        throw new IllegalStateException("Tern's Spark plugin " + jar + " is built for " + builtFor
                + " but this is Spark " + running + ": "
                + (other == null ? "Tern's plugin serves Spark 3.5 (" + JAR_35 + ") and 4.0 to 4.3 (" + JAR_4 + ")"
                        : "use " + other + " instead"));
    }
}
