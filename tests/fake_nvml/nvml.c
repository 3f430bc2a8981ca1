/*
 * A fake libnvidia-ml.so.1: just enough of NVML for activities/agent/gpus.py, so that tests run our real NVML code,
 * through the real pynvml bindings, on GPUs that do not exist. Built by the tests (tests/fake_nvml/build.py):
 *     gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 nvml.c
 * and loaded by a process started with LD_LIBRARY_PATH pointing at it. The environment says what it fakes:
 *   FAKE_NVML_COUNT           how many GPUs (default 2)
 *   FAKE_NVML_NAME            their model (default "NVIDIA H100 80GB HBM3")
 *   FAKE_NVML_MEMORY          their memory in bytes (default 80 GiB)
 *   FAKE_NVML_LOST            the index of a GPU that answers "GPU is lost" to every call about it
 *   FAKE_NVML_PAGES_PENDING   indices of GPUs with retired pages pending, e.g. "1,3"
 *   FAKE_NVML_ROWS_PENDING    indices of GPUs with remapped rows pending
 *   FAKE_NVML_ROWS_FAILED     indices of GPUs whose row remapping failed
 *   FAKE_NVML_NOT_SUPPORTED   functions that answer NVML_ERROR_NOT_SUPPORTED, e.g. "nvmlDeviceGetRemappedRows"
 *   FAKE_NVML_XID_FILE        a file of Xid events, one "INDEX XID" line each, appended while the process runs
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    SUCCESS = 0, ERROR_UNINITIALIZED = 1, ERROR_INVALID_ARGUMENT = 2, ERROR_NOT_SUPPORTED = 3, ERROR_TIMEOUT = 10,
    ERROR_GPU_IS_LOST = 15, ERROR_UNKNOWN = 999,
};
#define XID_CRITICAL_ERROR 8ULL

typedef struct { unsigned long long total, free, used; } memory_t;
typedef struct {
    void *device;
    unsigned long long eventType, eventData;
    unsigned gpuInstanceId, computeInstanceId;
} event_data_t;
typedef struct { long offset; unsigned long long registered; } event_set_t;

static int initialized;

static unsigned env_uint(const char *name, unsigned fallback) {
    const char *value = getenv(name);
    return value && *value ? (unsigned)strtoul(value, NULL, 10) : fallback;
}

/* Whether `index` is in the comma-separated list held by the variable `name`. */
static int listed(const char *name, unsigned index) {
    const char *value = getenv(name);
    char number[16];
    if (!value) return 0;
    snprintf(number, sizeof number, "%u", index);
    for (const char *p = value; *p;) {
        size_t n = strcspn(p, ",");
        if (n == strlen(number) && strncmp(p, number, n) == 0) return 1;
        p += n + (p[n] == ',');
    }
    return 0;
}

static int not_supported(const char *function) {
    const char *value = getenv("FAKE_NVML_NOT_SUPPORTED");
    if (!value) return 0;
    size_t n = strlen(function);
    for (const char *p = strstr(value, function); p; p = strstr(p + 1, function))
        if ((p == value || p[-1] == ',') && (p[n] == ',' || p[n] == '\0')) return 1;
    return 0;
}

static unsigned count(void) { return env_uint("FAKE_NVML_COUNT", 2); }
static void *handle_of(unsigned index) { return (void *)(uintptr_t)(index + 1); }

/* The index of a device handle, or -1 for one this library never gave out. */
static long index_of(void *handle) {
    uintptr_t value = (uintptr_t)handle;
    return value >= 1 && value <= count() ? (long)(value - 1) : -1;
}

static int lost(long index) { return getenv("FAKE_NVML_LOST") && env_uint("FAKE_NVML_LOST", 0) == (unsigned)index; }

/* Every call about a device: the library is initialized, the handle is one of ours, and that GPU is not lost. */
#define DEVICE(handle, index)                                         \
    long index = index_of(handle);                                    \
    if (!initialized) return ERROR_UNINITIALIZED;                     \
    if (index < 0) return ERROR_INVALID_ARGUMENT;                     \
    if (lost(index)) return ERROR_GPU_IS_LOST;

int nvmlInitWithFlags(unsigned flags) { (void)flags; initialized++; return SUCCESS; }
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlShutdown(void) {
    if (!initialized) return ERROR_UNINITIALIZED;
    initialized--;
    return SUCCESS;
}

const char *nvmlErrorString(int result) {
    switch (result) {
    case SUCCESS: return "Success";
    case ERROR_UNINITIALIZED: return "Uninitialized";
    case ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case ERROR_NOT_SUPPORTED: return "Not Supported";
    case ERROR_TIMEOUT: return "Timeout";
    case ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

int nvmlDeviceGetCount_v2(unsigned *n) {
    if (!initialized) return ERROR_UNINITIALIZED;
    *n = count();
    return SUCCESS;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned index, void **handle) {
    if (!initialized) return ERROR_UNINITIALIZED;
    if (index >= count()) return ERROR_INVALID_ARGUMENT;
    *handle = handle_of(index);
    return SUCCESS;
}

int nvmlDeviceGetIndex(void *handle, unsigned *out) {
    DEVICE(handle, index);
    *out = (unsigned)index;
    return SUCCESS;
}

int nvmlDeviceGetName(void *handle, char *name, unsigned length) {
    DEVICE(handle, index);
    const char *model = getenv("FAKE_NVML_NAME");
    snprintf(name, length, "%s", model && *model ? model : "NVIDIA H100 80GB HBM3");
    return SUCCESS;
}

int nvmlDeviceGetUUID(void *handle, char *uuid, unsigned length) {
    DEVICE(handle, index);
    snprintf(uuid, length, "GPU-fake-%ld", index);
    return SUCCESS;
}

int nvmlDeviceGetMemoryInfo(void *handle, memory_t *memory) {
    DEVICE(handle, index);
    const char *total = getenv("FAKE_NVML_MEMORY");
    memory->total = total && *total ? strtoull(total, NULL, 10) : 85899345920ULL;
    memory->free = memory->total;
    memory->used = 0;
    return SUCCESS;
}

int nvmlDeviceGetRetiredPagesPendingStatus(void *handle, int *pending) {
    DEVICE(handle, index);
    if (not_supported("nvmlDeviceGetRetiredPagesPendingStatus")) return ERROR_NOT_SUPPORTED;
    *pending = listed("FAKE_NVML_PAGES_PENDING", (unsigned)index); /* NVML_FEATURE_ENABLED is 1 */
    return SUCCESS;
}

int nvmlDeviceGetRemappedRows(void *handle, unsigned *corrected, unsigned *uncorrected, unsigned *pending,
                              unsigned *failed) {
    DEVICE(handle, index);
    if (not_supported("nvmlDeviceGetRemappedRows")) return ERROR_NOT_SUPPORTED;
    *pending = listed("FAKE_NVML_ROWS_PENDING", (unsigned)index);
    *failed = listed("FAKE_NVML_ROWS_FAILED", (unsigned)index);
    *corrected = *pending;
    *uncorrected = *failed;
    return SUCCESS;
}

int nvmlDeviceGetSupportedEventTypes(void *handle, unsigned long long *types) {
    DEVICE(handle, index);
    *types = not_supported("nvmlDeviceRegisterEvents") ? 0 : XID_CRITICAL_ERROR;
    return SUCCESS;
}

int nvmlEventSetCreate(event_set_t **set) {
    if (!initialized) return ERROR_UNINITIALIZED;
    *set = calloc(1, sizeof **set);
    return *set ? SUCCESS : ERROR_UNKNOWN;
}

int nvmlEventSetFree(event_set_t *set) {
    free(set);
    return SUCCESS;
}

int nvmlDeviceRegisterEvents(void *handle, unsigned long long types, event_set_t *set) {
    DEVICE(handle, index);
    if (not_supported("nvmlDeviceRegisterEvents")) return ERROR_NOT_SUPPORTED;
    if (types & XID_CRITICAL_ERROR) set->registered |= 1ULL << index;
    return SUCCESS;
}

/* The next Xid event of a registered GPU from FAKE_NVML_XID_FILE, read from where the last call stopped. */
static int next_event(event_set_t *set, event_data_t *data) {
    const char *path = getenv("FAKE_NVML_XID_FILE");
    FILE *file = path ? fopen(path, "r") : NULL;
    char line[128];
    int found = 0;
    if (!file) return 0;
    fseek(file, set->offset, SEEK_SET);
    while (!found && fgets(line, sizeof line, file) && strchr(line, '\n')) {
        unsigned index;
        unsigned long long xid;
        set->offset = ftell(file);
        if (sscanf(line, "%u %llu", &index, &xid) == 2 && index < count() && (set->registered >> index & 1)) {
            memset(data, 0, sizeof *data);
            data->device = handle_of(index);
            data->eventType = XID_CRITICAL_ERROR;
            data->eventData = xid;
            found = 1;
        }
    }
    fclose(file);
    return found;
}

int nvmlEventSetWait_v2(event_set_t *set, event_data_t *data, unsigned timeout_ms) {
    struct timespec pause = {0, 10 * 1000 * 1000};
    if (!initialized) return ERROR_UNINITIALIZED;
    for (unsigned waited = 0;; waited += 10) {
        if (next_event(set, data)) return SUCCESS;
        if (waited >= timeout_ms) return ERROR_TIMEOUT;
        nanosleep(&pause, NULL);
    }
}
