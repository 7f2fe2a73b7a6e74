package io.tern.spark;

import java.io.ByteArrayOutputStream;
import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.Locale;

/**
 * Loads libtern_spark once per JVM: from {@code java.library.path} if it is there, else the copy
 * for this platform bundled in the jar ({@code native/linux-<arch>/libtern_spark.so}), unpacked
 * into a directory that must allow executing mapped files. The directory is the first set of:
 * the one given ({@code spark.tern.nativeDir}, else Spark's first local directory, see {@link
 * TernConf#nativeDir}), the system property {@code tern.nativeDir}, the environment variable
 * {@code TERN_SPARK_NATIVE_DIR}, and {@code java.io.tmpdir}. The file is named by its content's
 * hash, so the executors of one host share one copy and a new build never meets an old one.
 */
public final class NativeLibrary {
    private NativeLibrary() {}

    /** The setting that names the directory, as errors tell users to set it. */
    static final String SETTING = "spark.tern.nativeDir (or -Dtern.nativeDir=DIR, or TERN_SPARK_NATIVE_DIR)";

    /**
     * The version of the native functions this jar calls; the library's {@code abi()} must say
     * the same (spark-shuffle/src/lib.rs, JNI_ABI). JNI binds by name only, so without this a
     * stale library found on java.library.path would be called with arguments it does not take.
     */
    static final int ABI = 2;

    private static String loadedFrom;

    private static native int abi();

    /** Loads the library unless it is loaded; {@code dir} (may be null) is where to unpack it. */
    public static synchronized String load(String dir) {
        if (loadedFrom != null) {
            return loadedFrom;
        }
        try {
            System.loadLibrary("tern_spark");
            loadedFrom = checkAbi("java.library.path");
            return loadedFrom;
        } catch (UnsatisfiedLinkError notOnPath) {
            if (isAbiMismatch(notOnPath)) {
                throw notOnPath; // A stale library is loaded: the bundled one cannot replace it.
            }
            // The copy bundled in the jar, then.
        }
        String platform = platform();
        String resource = "/native/" + platform + "/libtern_spark.so";
        byte[] library = read(resource);
        if (library == null) {
            throw new UnsatisfiedLinkError("the Tern Spark jar has no native library for " + platform
                    + " (it holds: " + bundledPlatforms() + "); build the jar with spark-shuffle/build.sh");
        }
        File directory = new File(chooseDirectory(dir), "tern-native");
        File file = unpack(library, directory);
        try {
            System.load(file.getAbsolutePath());
        } catch (UnsatisfiedLinkError e) {
            String message = String.valueOf(e.getMessage());
            if (message.contains("failed to map segment") || message.contains("Operation not permitted")) {
                throw new UnsatisfiedLinkError("cannot load " + file + ": its directory " + directory
                        + " does not allow executing files (mounted noexec?); set " + SETTING
                        + " to a directory that does (" + message + ")");
            }
            throw e;
        }
        loadedFrom = checkAbi(file.getAbsolutePath());
        return loadedFrom;
    }

    private static final String MISMATCH = "is not the one this Tern Spark jar was built with";

    /** {@code from} when the loaded library's functions are this jar's; a one-line error if not. */
    private static String checkAbi(String from) {
        int found;
        try {
            found = abi();
        } catch (UnsatisfiedLinkError old) {
            found = 1; // Libraries before the check had no abi().
        }
        if (found != ABI) {
            throw new UnsatisfiedLinkError("the libtern_spark.so loaded from " + from + " (native ABI " + found
                    + ") " + MISMATCH + " (ABI " + ABI + "): remove the stale library from java.library.path"
                    + " or rebuild both with spark-shuffle/build.sh");
        }
        return from;
    }

    private static boolean isAbiMismatch(UnsatisfiedLinkError e) {
        return String.valueOf(e.getMessage()).contains(MISMATCH);
    }

    /** {@code linux-x86_64} or {@code linux-aarch64}, as the jar's paths name platforms. */
    static String platform() {
        String os = System.getProperty("os.name", "").toLowerCase(Locale.ROOT);
        String arch = System.getProperty("os.arch", "").toLowerCase(Locale.ROOT);
        if (arch.equals("amd64") || arch.equals("x86_64")) {
            arch = "x86_64";
        } else if (arch.equals("aarch64") || arch.equals("arm64")) {
            arch = "aarch64";
        }
        return (os.startsWith("linux") ? "linux" : os.replace(' ', '_')) + "-" + arch;
    }

    private static String chooseDirectory(String given) {
        for (String dir : new String[] {given, System.getProperty("tern.nativeDir"), System.getenv("TERN_SPARK_NATIVE_DIR")}) {
            if (dir != null && !dir.isEmpty()) {
                return dir;
            }
        }
        return System.getProperty("java.io.tmpdir");
    }

    /** Writes the library as {@code DIR/libtern_spark-<hash>.so} unless it is there already. */
    private static File unpack(byte[] library, File directory) {
        File file = new File(directory, "libtern_spark-" + sha256(library).substring(0, 16) + ".so");
        if (file.isFile() && file.length() == library.length) {
            return file;
        }
        try {
            Files.createDirectories(directory.toPath());
            // A unique name, then a rename: concurrent executors never load a half-written file.
            Path partial = Files.createTempFile(directory.toPath(), "libtern_spark", ".partial");
            try {
                Files.write(partial, library);
                Files.move(partial, file.toPath(), StandardCopyOption.ATOMIC_MOVE, StandardCopyOption.REPLACE_EXISTING);
            } finally {
                Files.deleteIfExists(partial);
            }
        } catch (IOException e) {
            throw new UnsatisfiedLinkError("unpacking libtern_spark into " + directory + ": " + e
                    + "; set " + SETTING + " to a writable directory");
        }
        return file;
    }

    private static byte[] read(String resource) {
        try (InputStream in = NativeLibrary.class.getResourceAsStream(resource)) {
            if (in == null) {
                return null;
            }
            ByteArrayOutputStream bytes = new ByteArrayOutputStream();
            byte[] buffer = new byte[1 << 16];
            for (int n; (n = in.read(buffer)) > 0; ) {
                bytes.write(buffer, 0, n);
            }
            return bytes.toByteArray();
        } catch (IOException e) {
            throw new UnsatisfiedLinkError("reading " + resource + " from the jar: " + e);
        }
    }

    private static String bundledPlatforms() {
        byte[] index = read("/native/platforms.txt");
        return index == null ? "none" : new String(index, StandardCharsets.UTF_8).trim().replace('\n', ' ');
    }

    private static String sha256(byte[] bytes) {
        try {
            StringBuilder hex = new StringBuilder();
            for (byte b : MessageDigest.getInstance("SHA-256").digest(bytes)) {
                hex.append(String.format("%02x", b));
            }
            return hex.toString();
        } catch (NoSuchAlgorithmException e) {
            throw new IllegalStateException(e);
        }
    }

    /** {@code java -cp tern-spark.jar io.tern.spark.NativeLibrary [DIR]}: loads, says from where. */
    public static void main(String[] args) {
        System.out.println("loaded libtern_spark from " + load(args.length > 0 ? args[0] : null));
    }
}
