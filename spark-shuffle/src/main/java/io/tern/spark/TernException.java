package io.tern.spark;

/**
 * An error from Tern's native client: {@link #kind()} says what a caller can do about it
 * ("data-lost": recompute; "unavailable": retry later; "not-found", "invalid", "corrupt",
 * "out-of-space", "internal", or "panic"/"jni" for a fault in the bridge itself), the message says
 * which shuffle, partition or server and why.
 */
public class TernException extends RuntimeException {
    private static final long serialVersionUID = 1L;
    private final String kind;

    public TernException(String kind, String message) {
        super(message + " (" + kind + ")");
        this.kind = kind;
    }

    public String kind() {
        return kind;
    }

    public boolean isDataLost() {
        return "data-lost".equals(kind);
    }
}
