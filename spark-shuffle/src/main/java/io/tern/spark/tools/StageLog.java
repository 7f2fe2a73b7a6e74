package io.tern.spark.tools;

import java.util.ArrayList;
import java.util.List;

import org.apache.spark.scheduler.SparkListener;
import org.apache.spark.scheduler.SparkListenerExecutorAdded;
import org.apache.spark.scheduler.SparkListenerStageSubmitted;
import org.apache.spark.scheduler.SparkListenerTaskEnd;
import org.apache.spark.scheduler.StageInfo;

/**
 * A listener that records stage attempts, task ends and executors added, for the test suite to
 * check how Spark recovered (which stages were resubmitted, which partitions reran) and where
 * tasks ran. {@link #json()} gives
 * {"stages": [[stageId, attempt, shuffleId or -1, numTasks], ...],
 *  "tasks": [[stageId, attempt, partition, successful (0/1), "executor id"], ...],
 *  "executors": [["executor id", resource profile id, cores], ...]} in event order.
 */
public final class StageLog extends SparkListener {
    private final List<String> stages = new ArrayList<>();
    private final List<String> tasks = new ArrayList<>();
    private final List<String> executors = new ArrayList<>();

    @Override
    public synchronized void onStageSubmitted(SparkListenerStageSubmitted event) {
        StageInfo info = event.stageInfo();
        int shuffle = info.shuffleDepId().isDefined() ? (Integer) info.shuffleDepId().get() : -1;
        stages.add("[" + info.stageId() + "," + info.attemptNumber() + "," + shuffle + "," + info.numTasks() + "]");
    }

    @Override
    public synchronized void onTaskEnd(SparkListenerTaskEnd event) {
        tasks.add("[" + event.stageId() + "," + event.stageAttemptId() + "," + event.taskInfo().partitionId() + ","
                + (event.taskInfo().successful() ? 1 : 0) + ",\"" + event.taskInfo().executorId() + "\"]");
    }

    @Override
    public synchronized void onExecutorAdded(SparkListenerExecutorAdded event) {
        executors.add("[\"" + event.executorId() + "\"," + event.executorInfo().resourceProfileId() + ","
                + event.executorInfo().totalCores() + "]");
    }

    public synchronized void clear() {
        stages.clear();
        tasks.clear();
        executors.clear();
    }

    public synchronized String json() {
        return "{\"stages\":[" + String.join(",", stages) + "],\"tasks\":[" + String.join(",", tasks)
                + "],\"executors\":[" + String.join(",", executors) + "]}";
    }
}
