/*
 * A stand-in for libnvidia-ml.so.1, so the NVML sampler is tested through the real
 * nvidia-ml-py binding on machines without an NVIDIA GPU.
 *
 * Only the entry points the sampler reaches are exported, with NVML's C signatures and struct
 * layouts (those pynvml declares with ctypes). Their answers come from a scenario file named by
 * the environment variable FAKE_NVML_SCENARIO, read at nvmlInit: one `key=value` per line,
 * `#` starts a comment.
 *
 *   devices=2                       number of GPUs (default 0: "no GPU")
 *   init_error=DRIVER_NOT_LOADED    nvmlInit fails with this NVML error
 *                                   (LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED, NO_PERMISSION, UNKNOWN)
 *   power_sample_ms=20              period of the TOTAL_POWER sample buffer
 *   util_sample_ms=50               period of the utilisation and per-process sample buffers
 *   buffer_samples=100              samples each buffer keeps
 *   pcie_delay_ms=20                how long nvmlDeviceGetPcieThroughput blocks (default 0);
 *                                   the driver counts bytes over 20 ms inside the call
 *   dN.power=0:100000,500:250000    power curve of device N: piecewise constant steps
 *                                   (offset ms within the period : mW)
 *   dN.period_ms=1000               period of that curve, in ms of Unix time (default 1000)
 *   dN.util_gpu=70  dN.util_mem=30  utilisation in %
 *   dN.clock_sm= dN.clock_mem= dN.app_clock_sm= dN.app_clock_mem=   MHz
 *   dN.power_limit=300000 (mW)  dN.pstate=0  dN.temperature=45 (C)
 *   dN.pcie_tx=1000 dN.pcie_rx=2000 (KB/s)
 *   dN.unsupported=energy,pcie,...  calls answering NVML_ERROR_NOT_SUPPORTED; names:
 *       power_instant power_average power_usage energy utilization clock app_clock
 *       power_limit power_state temperature pcie samples_power samples_util samples_mem
 *       processes
 *   dN.proc=1234:60:10              a process (pid:sm%:mem%) in every sample, sharing the GPU
 *                                   with the others (MPS-like); repeat the key for more processes
 *   dN.fail=energy:GPU_IS_LOST,...  calls (by the names of call_cost_us) that fail with this
 *                                   NVML error every time (NO_PERMISSION, NOT_SUPPORTED,
 *                                   GPU_IS_LOST, TIMEOUT, UNKNOWN...); `energy` also fails the
 *                                   energy field of nvmlDeviceGetFieldValues
 *   dN.mig=1                        MIG mode on: nvmlDeviceGetMigMode answers 1 and the
 *                                   per-process utilisation NOT_SUPPORTED, as the driver does
 *   dN.gpm=1                        the GPU has GPM (Hopper and newer): nvmlGpmQueryDeviceSupport
 *                                   says so and nvmlGpmMigSampleGet answers (default 0: an
 *                                   older GPU, whose support query says "not supported")
 *   dN.gi=1:70:50                   under MIG, a GPU instance (id:graphics %:SM %, the SM % is
 *                                   optional and defaults to the graphics %), busy that share of
 *                                   every moment: its GPM counters grow by exactly that much
 *                                   per µs, so a metric over two samples is the share itself
 *                                   (up to 1000: above 100 it plays a faulty driver);
 *                                   repeat the key for more instances (one compute instance,
 *                                   one MIG device each, in the order given)
 *   dN.gi_until_ms=3:3000           GPU instance 3 is destroyed 3000 ms after nvmlInit: it is
 *                                   no longer listed, and its GPM samples answer NOT_FOUND
 *   dN.gi_proc=1:4242               pid 4242 runs on GPU instance 1 (after that instance's
 *                                   dN.gi line): its MIG device's
 *                                   nvmlDeviceGetComputeRunningProcesses lists it; repeatable
 *
 * Time-slicing, as the driver sees it (replaces dN.proc and dN.power for that device):
 *
 *   dN.slice=1000:0:11,700:12,900:-  who holds the engine: a period in ms, then offset:pid
 *                                   steps within it (`-` or 0: nobody, the engine idles;
 *                                   `~11`: pid 11's context is resident but runs nothing)
 *   dN.slice_jitter_ms=150          each period's schedule is rotated by a pseudo-random
 *                                   0..150 ms (whole ms; see `rotation`), so it cannot lock to
 *                                   the sampling; every period still gives each pid its share
 *   dN.life=12:1700000002000:1700000005000   pid 12 holds its slots only from the first to
 *                                   the second Unix time in ms (it starts, then exits); its
 *                                   slots are idle outside; repeatable
 *   dN.idle_mw=60000                power with nobody on the engine
 *   dN.pid_power=11:300000          power above idle while pid 11 holds the engine (default
 *                                   dN.busy_mw=200000); repeatable
 *
 *   In that mode the driver's utilisation samples are driver-like: every util_sample_ms
 *   (e.g. 200) one sample holds the engine's busy % over the sample period and the ONE pid
 *   holding the engine at the sample's instant, in a ring of buffer_samples (e.g. 72).
 *   nvmlDeviceGetProcessUtilization answers one entry per pid, averaged over all the samples
 *   newer than lastSeenTimeStamp (a sample naming another pid, or none, counts as 0), stamped
 *   with that pid's newest sample. Everything is piecewise constant on whole milliseconds of
 *   Unix time, so a test computes exact truths with the same rules.
 *
 * Tenants: processes that come and go and draw power of their own (replaces dN.slice; all in
 * whole ms of Unix time, so a test mirrors it exactly, see tests/nvml_fake.py `Tenants`):
 *
 *   dN.tenant=PID:MW:DUTY:STRETCH_MS[:FROM_MS:TO_MS]
 *                                   a process drawing MW above idle while it holds the engine;
 *                                   it wants the engine in DUTY % of the STRETCH_MS-long
 *                                   stretches of time, which ones drawn by a seeded hash (DUTY
 *                                   100: all the time), and lives from FROM_MS to TO_MS (Unix
 *                                   ms; 0:0 or absent: always). Repeatable, up to 16; the same
 *                                   PID in two entries with lives apart is a reused pid
 *   dN.together=PID:WITH             PID wants the engine in exactly WITH's stretches (a pair
 *                                   that never runs apart)
 *   dN.timeslice_ms=1               while several tenants want the engine, each slice of this
 *                                   length goes to one of them, drawn by the seeded hash (the
 *                                   driver's default timeslice is about 1 ms)
 *   seed=7                          seeds the hashes (default 0)
 *
 *   With tenants, power (samples and the instantaneous field) is the mean over the power sample
 *   period before the reading, as a sensor averages: 1 ms slices of 700 W and 140 W read at an
 *   instant would be noise no driver shows.
 *
 *   energy_step_ms=100              the energy counter (call and field 83) moves only every
 *                                   step, as drivers' counters do (default 0: continuously)
 *
 * CPU cost and call counts (for the overhead benchmark):
 *
 *   call_costs=h100                 busy-spin per C call like an idle NVIDIA H100's driver
 *                                   (H100_COST_US: energy 3.8 ms, each C call of a utilisation
 *                                   buffer or of process utilisation 1.15-1.2 ms, power samples
 *                                   0.39 ms, utilisation rates 0.047 ms; field values 2 us +
 *                                   3 us per field, the instantaneous power field 80 us more,
 *                                   + the energy call's cost when the energy field is asked)
 *   call_costs=h200                 the same for an idle NVIDIA H200 (H200_COST_US: energy
 *                                   3.89 ms, field values with the energy field 4.51 ms,
 *                                   process utilisation 1.11 ms and each utilisation buffer
 *                                   1.09 ms per C call, power samples 0.165 ms per C call,
 *                                   power, utilisation rates, clocks, temperature and running
 *                                   processes 0.005 ms; field values 2 us + 1 us per field, the
 *                                   instantaneous power field 5 us more)
 *   call_cost_us=energy:4300,...    per call name (the `unsupported` names, plus field_values):
 *                                   CPU time each C call spins; overrides the preset
 *                                   (field_values_energy: what the energy field adds to a
 *                                   field-values call; 0, the default, is the energy call's cost)
 *   FAKE_NVML_CALLS=path            (environment) at nvmlShutdown, write `name count` per
 *                                   entry point: every C call, sizing calls included;
 *                                   `field_values_energy` counts the field-values calls that
 *                                   asked for the energy counter
 *
 * The curve is a function of absolute time (CLOCK_REALTIME, like NVML's CPU timestamps), so a
 * test can compute the expected value of any sample from its timestamp. The energy counter is
 * the exact integral of the curve since nvmlInit, so power and energy agree. Sample buffers hold
 * the samples on a fixed grid of absolute time and return only those newer than the timestamp
 * passed in, oldest first, as the driver does.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

enum { NVML_VALUE_TYPE_UNSIGNED_INT = 1, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3 };
enum { NVML_CLOCK_SM = 1, NVML_CLOCK_MEM = 2 };
enum { NVML_TOTAL_POWER_SAMPLES = 0, NVML_GPU_UTILIZATION_SAMPLES = 1,
       NVML_MEMORY_UTILIZATION_SAMPLES = 2 };
enum { NVML_PCIE_UTIL_TX_BYTES = 0, NVML_PCIE_UTIL_RX_BYTES = 1 };
enum { NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION = 83, NVML_FI_DEV_POWER_AVERAGE = 185,
       NVML_FI_DEV_POWER_INSTANT = 186, NVML_FI_DEV_ENERGY = 191 };

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned long long timeStamp;
    nvmlValue_t sampleValue;
} nvmlSample_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct {
    uint32_t fieldId;
    uint32_t scopeId;
    int64_t timestamp;
    int64_t latencyUsec;
    unsigned int valueType;
    unsigned int nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

#define MAX_DEVICES 16
#define MAX_STEPS 64
#define MAX_PROCS 16
#define MAX_SLOTS 32
#define MAX_GIS 7                       /* an A100 or H100 has at most 7 GPU instances */

enum {
    U_POWER_INSTANT = 1 << 0, U_POWER_AVERAGE = 1 << 1, U_POWER_USAGE = 1 << 2,
    U_ENERGY = 1 << 3, U_UTILIZATION = 1 << 4, U_CLOCK = 1 << 5, U_APP_CLOCK = 1 << 6,
    U_POWER_LIMIT = 1 << 7, U_POWER_STATE = 1 << 8, U_TEMPERATURE = 1 << 9, U_PCIE = 1 << 10,
    U_SAMPLES_POWER = 1 << 11, U_SAMPLES_UTIL = 1 << 12, U_SAMPLES_MEM = 1 << 13,
    U_PROCESSES = 1 << 14,
};

static const struct { const char *name; unsigned bit; } UNSUPPORTED_NAMES[] = {
    {"power_instant", U_POWER_INSTANT}, {"power_average", U_POWER_AVERAGE},
    {"power_usage", U_POWER_USAGE}, {"energy", U_ENERGY}, {"utilization", U_UTILIZATION},
    {"clock", U_CLOCK}, {"app_clock", U_APP_CLOCK}, {"power_limit", U_POWER_LIMIT},
    {"power_state", U_POWER_STATE}, {"temperature", U_TEMPERATURE}, {"pcie", U_PCIE},
    {"samples_power", U_SAMPLES_POWER}, {"samples_util", U_SAMPLES_UTIL},
    {"samples_mem", U_SAMPLES_MEM}, {"processes", U_PROCESSES},
};

/* Entry points, for call counts and costs: the `unsupported` names, plus field_values. */
enum {
    C_POWER_USAGE, C_ENERGY, C_FIELD_VALUES, C_UTILIZATION, C_CLOCK, C_APP_CLOCK, C_POWER_LIMIT,
    C_POWER_STATE, C_TEMPERATURE, C_PCIE, C_SAMPLES_POWER, C_SAMPLES_UTIL, C_SAMPLES_MEM,
    C_PROCESSES, C_FIELD_ENERGY, C_GPM_SUPPORT, C_GPM_SAMPLE, C_GPM_METRICS, C_RUNNING_PROCESSES,
    C_COUNT
};
static const char *CALL_NAMES[C_COUNT] = {
    "power_usage", "energy", "field_values", "utilization", "clock", "app_clock", "power_limit",
    "power_state", "temperature", "pcie", "samples_power", "samples_util", "samples_mem",
    "processes", "field_values_energy", "gpm_support", "gpm_sample", "gpm_metrics",
    "running_processes",
};
/* Field values cost their base (call_cost_us[C_FIELD_VALUES]) plus field_cost_us per field,
 * plus instant_field_us for the instantaneous power field, plus, when they include the energy
 * field (energy is what costs there), call_cost_us[C_FIELD_ENERGY], or the energy call's cost
 * where that is 0. */
static unsigned long long field_cost_us, instant_field_us;

/* CPU us per C call on an idle NVIDIA H100 (driver 580.159.04), from the project's timings
 * (time.thread_time, 2026-11-24 and -25): field values with POWER_INSTANT alone 0.082 ms, with
 * POWER_AVERAGE alone 0.005 ms, with the energy field 3.7-4.4 ms; the energy call 3.8 ms;
 * nvmlDeviceGetPowerUsage 0.013 ms; utilisation rates 0.047 ms; the power sample buffer
 * 0.39 ms in one call. The utilisation buffers (2.3-2.5 ms) and process utilisation (2.3 ms)
 * were timed through pynvml, which makes two C calls each (size, then fill): each C call here
 * is half of that (an assumption: the driver does not say what the sizing call costs alone). */
static const unsigned long long H100_COST_US[C_COUNT] = {
    /* power_usage energy field_values utilization clock app_clock power_limit */
    13, 3800, 2, 47, 50, 1000, 150,
    /* power_state temperature pcie samples_power samples_util samples_mem processes */
    50, 50, 800, 390, 1200, 1200, 1150,
    /* field_values_energy: 0, so the energy field costs what the energy call does */
    0,
    /* gpm_support gpm_sample gpm_metrics running_processes: never timed on the H100 (it ran
     * without MIG), so no cost is assumed; call_cost_us= gives them one */
    0, 0, 0, 0,
};
/* CPU us per C call on an idle NVIDIA H200 (driver 580.159.04, 2026-11-28; the research
 * notes' section 6), 40 calls each through nvidia-ml-py: the energy call 3.89 ms; field values
 * with five fields, the energy field among them, 4.51 ms; field values with POWER_INSTANT
 * alone, nvmlDeviceGetPowerUsage, utilisation rates, SM clock, temperature and
 * nvmlDeviceGetComputeRunningProcesses under 0.01 ms each; the sample buffers TOTAL_POWER
 * 0.33 ms and GPU_UTILIZATION 2.17 ms, and process utilisation 2.22 ms. As for the H100,
 * pynvml makes two C calls for each buffer (size, then fill), so each C call here is half of
 * what pynvml's call took (an assumption: the driver does not say what the sizing call costs
 * alone), and the calls under 0.01 ms are taken as 5 us each C call. Not timed on the H200,
 * so the H100's figures are kept: the memory utilisation buffer (as the GPU utilisation
 * one), application clocks, power limit, performance state, PCIe, and the GPM calls (none). */
static const unsigned long long H200_COST_US[C_COUNT] = {
    /* power_usage energy field_values utilization clock app_clock power_limit */
    5, 3890, 2, 5, 5, 1000, 150,
    /* power_state temperature pcie samples_power samples_util samples_mem processes */
    50, 5, 800, 165, 1085, 1085, 1110,
    /* field_values_energy: what the energy field adds to field values, 4.51 ms less the rest
     * of a five-field call */
    4500,
    /* gpm_support gpm_sample gpm_metrics running_processes */
    0, 0, 0, 5,
};
static unsigned long long call_cost_us[C_COUNT];
static unsigned long long call_count[C_COUNT];

typedef struct { unsigned int pid, sm, mem; } fake_proc;
typedef struct { unsigned int pid; unsigned long long from_ms, to_ms; } fake_life;
typedef struct { unsigned int pid, mw; } fake_pid_power;
/* A tenant process: its power above idle, its stretches of activity and its life. */
typedef struct {
    unsigned int pid, mw, duty, with_pid;
    unsigned long long stretch_ms, from_ms, to_ms;
} fake_tenant;

/* A GPU instance under MIG, with its one compute instance: a MIG device handle points here. */
struct fake_gi {
    unsigned int id, graphics, sm;      /* GPM activity, in % of every moment */
    unsigned long long until_us;        /* destroyed this long after nvmlInit; 0: never */
    int procs;
    unsigned int pid[MAX_PROCS];
};

/* The opaque nvmlDevice_t handles point at these. */
struct fake_device {
    unsigned index;
    unsigned long long period_us;
    int steps;
    unsigned long long step_at_us[MAX_STEPS]; /* offsets within the period, ascending */
    unsigned int step_mw[MAX_STEPS];
    unsigned int util_gpu, util_mem;
    unsigned int clock_sm, clock_mem, app_clock_sm, app_clock_mem;
    unsigned int power_limit, pstate, temperature, pcie_tx, pcie_rx;
    unsigned unsupported;
    int procs;
    fake_proc proc[MAX_PROCS];
    /* time-slicing: all in whole ms */
    unsigned long long slice_ms, jitter_ms;
    int slots;
    unsigned long long slot_at_ms[MAX_SLOTS];
    unsigned int slot_pid[MAX_SLOTS];
    int slot_busy[MAX_SLOTS];
    int lives;
    fake_life life[MAX_PROCS];
    int pid_powers;
    fake_pid_power pid_power[MAX_PROCS];
    unsigned int idle_mw, busy_mw;
    int tenants;
    fake_tenant tenant[MAX_PROCS];
    unsigned long long timeslice_ms;
    int fail[C_COUNT];                  /* NVML error each entry point fails with; 0: none */
    int mig, gpm;
    int gis;
    struct fake_gi gi[MAX_GIS];
    unsigned long long cache_ms;        /* energy integral up to cache_ms, in mW·ms */
    unsigned __int128 cache_energy;
    unsigned __int128 init_energy;      /* energy_to(init_us) */
    /* "now" of the last size query: the fill call that follows answers for the same moment,
     * so a sample grid point passing between the two calls cannot truncate the answer. */
    unsigned long long sizing_now_us[4];
};
typedef struct fake_device *nvmlDevice_t;

static struct fake_device devices[MAX_DEVICES];
static unsigned device_count;
static int initialised;
static unsigned long long init_us;
static unsigned long long power_sample_us = 20000, util_sample_us = 50000;
static unsigned long long pcie_delay_us = 0;
static unsigned long long buffer_samples = 100;
static unsigned long long energy_step_us = 0;
static unsigned long long seed = 0;

/* Burn `us` of this thread's CPU time, as a driver spinning on its firmware's answer does. */
static void spin(unsigned long long us) {
    if (!us) return;
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    unsigned long long end = (unsigned long long)ts.tv_sec * 1000000000ULL +
                             (unsigned long long)ts.tv_nsec + us * 1000ULL;
    for (;;) {
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
        if ((unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec >= end)
            return;
    }
}

static unsigned int busy_percent(const struct fake_device *d, unsigned long long t);

static void called(int which) {
    __atomic_add_fetch(&call_count[which], 1, __ATOMIC_RELAXED);
    spin(call_cost_us[which]);
}

/* ---- time-slicing: who holds the engine at each whole millisecond ---- */

/* How far period k's schedule is rotated, in ms: a fixed hash, mirrored by the tests. */
static unsigned long long rotation(const struct fake_device *d, unsigned long long k) {
    if (!d->jitter_ms) return 0;
    unsigned int h = (unsigned int)(k * 2654435761ULL);
    h ^= h >> 15;
    return h % (unsigned int)(d->jitter_ms + 1);
}

static int alive(const struct fake_device *d, unsigned int pid, unsigned long long ms) {
    int listed = 0;
    for (int i = 0; i < d->lives; i++) {
        if (d->life[i].pid != pid) continue;
        listed = 1;
        if (ms >= d->life[i].from_ms && ms < d->life[i].to_ms)
            return 1;
    }
    return !listed;
}

/* splitmix64's finaliser: the tenants' hash, mirrored by the tests. */
static unsigned long long mix(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* Whether tenant t is alive and wants the engine during millisecond `ms`. */
static int wants(const struct fake_device *d, const fake_tenant *t, unsigned long long ms) {
    if (t->to_ms && (ms < t->from_ms || ms >= t->to_ms)) return 0;
    const fake_tenant *leader = t;
    for (int i = 0; t->with_pid && i < d->tenants; i++)
        if (d->tenant[i].pid == t->with_pid) leader = &d->tenant[i];
    if (leader->duty >= 100) return 1;
    unsigned long long stretch = ms / (leader->stretch_ms ? leader->stretch_ms : 1000ULL);
    return mix(seed ^ mix((unsigned long long)leader->pid * 1000003ULL + stretch)) % 100ULL <
           leader->duty;
}

/* The tenant holding the engine during millisecond `ms`: among those that want it, the one the
 * seeded hash draws for this timeslice; NULL when none wants it. */
static const fake_tenant *holder(const struct fake_device *d, unsigned long long ms) {
    const fake_tenant *wanting[MAX_PROCS];
    int count = 0;
    for (int i = 0; i < d->tenants; i++)
        if (wants(d, &d->tenant[i], ms)) wanting[count++] = &d->tenant[i];
    if (!count) return NULL;
    unsigned long long slice = ms / (d->timeslice_ms ? d->timeslice_ms : 1ULL);
    return wanting[mix(seed * 31ULL + slice) % (unsigned long long)count];
}

/* The pid whose context is resident on the engine during millisecond `ms` (Unix time), 0 for
 * nobody; `busy` says whether the engine runs its work then. */
static unsigned int resident(const struct fake_device *d, unsigned long long ms, int *busy) {
    if (d->tenants) {
        const fake_tenant *t = holder(d, ms);
        *busy = t != NULL;
        return t ? t->pid : 0;
    }
    unsigned long long k = ms / d->slice_ms;
    unsigned long long offset = (ms % d->slice_ms + rotation(d, k)) % d->slice_ms;
    int slot = 0;
    for (int i = 0; i < d->slots && d->slot_at_ms[i] <= offset; i++) slot = i;
    unsigned int pid = d->slot_pid[slot];
    if (!pid || !alive(d, pid, ms)) {
        *busy = 0;
        return 0;
    }
    *busy = d->slot_busy[slot];
    return pid;
}

/* The pid running work on the engine during millisecond `ms`, 0 for nobody. */
static unsigned int owner(const struct fake_device *d, unsigned long long ms) {
    int busy = 0;
    unsigned int pid = resident(d, ms, &busy);
    return busy ? pid : 0;
}

static unsigned int slice_power_mw(const struct fake_device *d, unsigned long long ms) {
    if (d->tenants) {
        const fake_tenant *t = holder(d, ms);
        return d->idle_mw + (t ? t->mw : 0);
    }
    unsigned int pid = owner(d, ms);
    if (!pid) return d->idle_mw;
    for (int i = 0; i < d->pid_powers; i++)
        if (d->pid_power[i].pid == pid) return d->idle_mw + d->pid_power[i].mw;
    return d->idle_mw + d->busy_mw;
}

/* Energy of the slicing device from a fixed origin to t, in mW·µs. The integral is cached up
 * to the newest millisecond asked for and walked from there, forwards or back; the origin's
 * offset is a constant, which every difference of the counter cancels. */
static unsigned __int128 slice_energy_to(struct fake_device *d, unsigned long long t) {
    unsigned long long ms = t / 1000ULL;
    if (!d->cache_ms) {
        d->cache_ms = ms;
        d->cache_energy = (unsigned __int128)ms * 1000000ULL;
    }
    for (; d->cache_ms < ms; d->cache_ms++) d->cache_energy += slice_power_mw(d, d->cache_ms);
    unsigned __int128 energy = d->cache_energy;
    for (unsigned long long back = d->cache_ms; back > ms; back--)
        energy -= slice_power_mw(d, back - 1);
    return energy * 1000U + (unsigned __int128)slice_power_mw(d, ms) * (t % 1000ULL);
}

/* Milliseconds of [from_ms, to_ms) the engine was busy. */
static unsigned long long busy_ms(const struct fake_device *d, unsigned long long from_ms,
                                  unsigned long long to_ms) {
    unsigned long long busy = 0;
    for (unsigned long long ms = from_ms; ms < to_ms; ms++) busy += owner(d, ms) != 0;
    return busy;
}

static unsigned long long now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000ULL;
}

/* Power in mW at absolute time t (µs). */
static unsigned int power_at(const struct fake_device *d, unsigned long long t) {
    if (d->tenants) { /* the sensor's mean over the power sample period before t */
        unsigned long long end = t / 1000ULL, period = power_sample_us / 1000ULL, sum = 0;
        for (unsigned long long ms = end - period; ms < end; ms++) sum += slice_power_mw(d, ms);
        return (unsigned int)(sum / period);
    }
    if (d->slice_ms) return slice_power_mw(d, t / 1000ULL);
    unsigned long long offset = t % d->period_us;
    unsigned int mw = d->step_mw[0];
    for (int i = 0; i < d->steps && d->step_at_us[i] <= offset; i++) mw = d->step_mw[i];
    return mw;
}

/* Integral of the curve from absolute time 0 to t, in mW·µs (exact, 128-bit). */
static unsigned __int128 energy_to(struct fake_device *d, unsigned long long t) {
    if (d->slice_ms) return slice_energy_to(d, t);
    unsigned __int128 per_period = 0, partial = 0;
    unsigned long long offset = t % d->period_us;
    for (int i = 0; i < d->steps; i++) {
        unsigned long long start = d->step_at_us[i];
        unsigned long long end = i + 1 < d->steps ? d->step_at_us[i + 1] : d->period_us;
        per_period += (unsigned __int128)d->step_mw[i] * (end - start);
        if (offset > start)
            partial += (unsigned __int128)d->step_mw[i] * ((offset < end ? offset : end) - start);
    }
    return per_period * (t / d->period_us) + partial;
}

/* Energy in mJ since nvmlInit (up to the counter's last step, when it steps). */
static unsigned long long energy_mj(struct fake_device *d, unsigned long long t) {
    if (energy_step_us) t -= t % energy_step_us;
    return (unsigned long long)((energy_to(d, t) - d->init_energy) / 1000000U);
}

/* Average power over the second before t, as drivers report it for POWER_AVERAGE. */
static unsigned int power_average(struct fake_device *d, unsigned long long t) {
    return (unsigned int)((energy_to(d, t) - energy_to(d, t - 1000000ULL)) / 1000000U);
}

static int parse_error(const char *name) {
    if (!strcmp(name, "LIBRARY_NOT_FOUND")) return NVML_ERROR_LIBRARY_NOT_FOUND;
    if (!strcmp(name, "DRIVER_NOT_LOADED")) return NVML_ERROR_DRIVER_NOT_LOADED;
    if (!strcmp(name, "NO_PERMISSION")) return NVML_ERROR_NO_PERMISSION;
    if (!strcmp(name, "NOT_SUPPORTED")) return NVML_ERROR_NOT_SUPPORTED;
    if (!strcmp(name, "GPU_IS_LOST")) return NVML_ERROR_GPU_IS_LOST;
    if (!strcmp(name, "TIMEOUT")) return NVML_ERROR_TIMEOUT;
    return NVML_ERROR_UNKNOWN;
}

/* `energy:GPU_IS_LOST,processes:UNKNOWN`: entry points that fail, and how. */
static void parse_fail(struct fake_device *d, char *value) {
    for (char *item = strtok(value, ","); item; item = strtok(NULL, ",")) {
        char *colon = strchr(item, ':');
        if (!colon) continue;
        *colon = 0;
        for (int i = 0; i < C_COUNT; i++)
            if (!strcmp(item, CALL_NAMES[i])) d->fail[i] = parse_error(colon + 1);
    }
}

static void parse_power(struct fake_device *d, char *value) {
    d->steps = 0;
    for (char *item = strtok(value, ","); item && d->steps < MAX_STEPS; item = strtok(NULL, ",")) {
        unsigned long long at_ms = 0;
        unsigned int mw = 0;
        if (sscanf(item, "%llu:%u", &at_ms, &mw) == 2) {
            d->step_at_us[d->steps] = at_ms * 1000ULL;
            d->step_mw[d->steps] = mw;
            d->steps++;
        }
    }
}

static void parse_unsupported(struct fake_device *d, char *value) {
    for (char *item = strtok(value, ","); item; item = strtok(NULL, ",")) {
        for (size_t i = 0; i < sizeof UNSUPPORTED_NAMES / sizeof UNSUPPORTED_NAMES[0]; i++)
            if (!strcmp(item, UNSUPPORTED_NAMES[i].name)) d->unsupported |= UNSUPPORTED_NAMES[i].bit;
    }
}

/* `1000:0:11,700:12,900:-`: a period in ms, then offset:pid steps (`-` for nobody). */
static void parse_slice(struct fake_device *d, char *value) {
    char *rest = NULL;
    d->slice_ms = strtoull(value, &rest, 10);
    d->slots = 0;
    if (!d->slice_ms || !rest || *rest != ':') {
        d->slice_ms = 0;
        return;
    }
    for (char *item = strtok(rest + 1, ","); item && d->slots < MAX_SLOTS;
         item = strtok(NULL, ",")) {
        char *colon = strchr(item, ':');
        if (!colon) continue;
        d->slot_at_ms[d->slots] = strtoull(item, NULL, 10);
        char *pid = colon + 1;
        d->slot_busy[d->slots] = *pid != '-' && *pid != '~';
        d->slot_pid[d->slots] = *pid == '-' ? 0 : (unsigned)strtoul(pid + (*pid == '~'), NULL, 10);
        if (!d->slot_pid[d->slots]) d->slot_busy[d->slots] = 0;
        d->slots++;
    }
}

static void parse_call_costs(char *value) {
    for (char *item = strtok(value, ","); item; item = strtok(NULL, ",")) {
        char *colon = strchr(item, ':');
        if (!colon) continue;
        *colon = 0;
        for (int i = 0; i < C_COUNT; i++)
            if (!strcmp(item, CALL_NAMES[i])) call_cost_us[i] = strtoull(colon + 1, NULL, 10);
    }
}

static void device_key(struct fake_device *d, const char *key, char *value) {
    unsigned long v = strtoul(value, NULL, 10);
    if (!strcmp(key, "power")) parse_power(d, value);
    else if (!strcmp(key, "slice")) parse_slice(d, value);
    else if (!strcmp(key, "slice_jitter_ms")) d->jitter_ms = v;
    else if (!strcmp(key, "idle_mw")) d->idle_mw = (unsigned)v;
    else if (!strcmp(key, "tenant") && d->tenants < MAX_PROCS) {
        fake_tenant *t = &d->tenant[d->tenants];
        memset(t, 0, sizeof *t);
        int read = sscanf(value, "%u:%u:%u:%llu:%llu:%llu", &t->pid, &t->mw, &t->duty,
                          &t->stretch_ms, &t->from_ms, &t->to_ms);
        if ((read == 4 || read == 6) && t->pid) {
            d->tenants++;
            if (!d->slice_ms) d->slice_ms = 1; /* the time-slicing driver's samples, below */
        }
    } else if (!strcmp(key, "together")) {
        unsigned int pid = 0, with = 0;
        if (sscanf(value, "%u:%u", &pid, &with) == 2)
            for (int i = 0; i < d->tenants; i++)
                if (d->tenant[i].pid == pid) d->tenant[i].with_pid = with;
    } else if (!strcmp(key, "timeslice_ms")) d->timeslice_ms = v;
    else if (!strcmp(key, "busy_mw")) d->busy_mw = (unsigned)v;
    else if (!strcmp(key, "life") && d->lives < MAX_PROCS) {
        fake_life *l = &d->life[d->lives];
        if (sscanf(value, "%u:%llu:%llu", &l->pid, &l->from_ms, &l->to_ms) == 3) d->lives++;
    } else if (!strcmp(key, "pid_power") && d->pid_powers < MAX_PROCS) {
        fake_pid_power *pp = &d->pid_power[d->pid_powers];
        if (sscanf(value, "%u:%u", &pp->pid, &pp->mw) == 2) d->pid_powers++;
    }
    else if (!strcmp(key, "period_ms")) d->period_us = v ? v * 1000ULL : 1000000ULL;
    else if (!strcmp(key, "util_gpu")) d->util_gpu = (unsigned)v;
    else if (!strcmp(key, "util_mem")) d->util_mem = (unsigned)v;
    else if (!strcmp(key, "clock_sm")) d->clock_sm = (unsigned)v;
    else if (!strcmp(key, "clock_mem")) d->clock_mem = (unsigned)v;
    else if (!strcmp(key, "app_clock_sm")) d->app_clock_sm = (unsigned)v;
    else if (!strcmp(key, "app_clock_mem")) d->app_clock_mem = (unsigned)v;
    else if (!strcmp(key, "power_limit")) d->power_limit = (unsigned)v;
    else if (!strcmp(key, "pstate")) d->pstate = (unsigned)v;
    else if (!strcmp(key, "temperature")) d->temperature = (unsigned)v;
    else if (!strcmp(key, "pcie_tx")) d->pcie_tx = (unsigned)v;
    else if (!strcmp(key, "pcie_rx")) d->pcie_rx = (unsigned)v;
    else if (!strcmp(key, "unsupported")) parse_unsupported(d, value);
    else if (!strcmp(key, "fail")) parse_fail(d, value);
    else if (!strcmp(key, "mig")) d->mig = (int)v;
    else if (!strcmp(key, "gpm")) d->gpm = (int)v;
    else if (!strcmp(key, "gi") && d->gis < MAX_GIS) {
        struct fake_gi *gi = &d->gi[d->gis];
        int read = sscanf(value, "%u:%u:%u", &gi->id, &gi->graphics, &gi->sm);
        if (read == 2) gi->sm = gi->graphics;
        if (read >= 2 && gi->graphics <= 1000 && gi->sm <= 1000) d->gis++;
    } else if (!strcmp(key, "gi_until_ms")) {
        unsigned int id = 0;
        unsigned long long ms = 0;
        if (sscanf(value, "%u:%llu", &id, &ms) == 2)
            for (int i = 0; i < d->gis; i++)
                if (d->gi[i].id == id) d->gi[i].until_us = ms * 1000ULL;
    } else if (!strcmp(key, "gi_proc")) {
        unsigned int id = 0, pid = 0;
        if (sscanf(value, "%u:%u", &id, &pid) == 2)
            for (int i = 0; i < d->gis; i++)
                if (d->gi[i].id == id && d->gi[i].procs < MAX_PROCS)
                    d->gi[i].pid[d->gi[i].procs++] = pid;
    }
    else if (!strcmp(key, "proc") && d->procs < MAX_PROCS) {
        fake_proc *p = &d->proc[d->procs];
        if (sscanf(value, "%u:%u:%u", &p->pid, &p->sm, &p->mem) == 3) d->procs++;
    }
}

static void defaults(void) {
    memset(devices, 0, sizeof devices);
    for (unsigned i = 0; i < MAX_DEVICES; i++) {
        struct fake_device *d = &devices[i];
        d->index = i;
        d->period_us = 1000000ULL;
        d->steps = 1;
        d->step_mw[0] = 100000;
        d->util_gpu = 50;
        d->util_mem = 20;
        d->clock_sm = 1410;
        d->clock_mem = 1215;
        d->app_clock_sm = 1410;
        d->app_clock_mem = 1215;
        d->power_limit = 300000;
        d->temperature = 40;
        d->pcie_tx = 1000;
        d->pcie_rx = 2000;
        d->busy_mw = 200000;
    }
    memset(call_cost_us, 0, sizeof call_cost_us);
    field_cost_us = 0;
    instant_field_us = 0;
    device_count = 0;
    energy_step_us = 0;
    seed = 0;
    power_sample_us = 20000;
    pcie_delay_us = 0;
    util_sample_us = 50000;
    buffer_samples = 100;
}

/* Read the scenario; return an NVML error to fail nvmlInit with, or NVML_SUCCESS. */
static nvmlReturn_t load_scenario(void) {
    defaults();
    const char *path = getenv("FAKE_NVML_SCENARIO");
    if (!path) return NVML_SUCCESS;
    FILE *file = fopen(path, "r");
    if (!file) return NVML_ERROR_UNKNOWN;
    nvmlReturn_t result = NVML_SUCCESS;
    char line[4096];
    while (fgets(line, sizeof line, file)) {
        line[strcspn(line, "\r\n#")] = 0;
        char *eq = strchr(line, '=');
        if (!eq) continue;
        *eq = 0;
        char *key = line, *value = eq + 1;
        unsigned long v = strtoul(value, NULL, 10);
        unsigned index = 0;
        int used = 0;
        if (!strcmp(key, "devices")) device_count = v < MAX_DEVICES ? (unsigned)v : MAX_DEVICES;
        else if (!strcmp(key, "init_error")) result = parse_error(value);
        else if (!strcmp(key, "power_sample_ms")) power_sample_us = v ? v * 1000ULL : 20000ULL;
        else if (!strcmp(key, "util_sample_ms")) util_sample_us = v ? v * 1000ULL : 50000ULL;
        else if (!strcmp(key, "buffer_samples")) buffer_samples = v ? v : 100;
        else if (!strcmp(key, "pcie_delay_ms")) pcie_delay_us = v * 1000ULL;
        else if (!strcmp(key, "energy_step_ms")) energy_step_us = v * 1000ULL;
        else if (!strcmp(key, "seed")) seed = strtoull(value, NULL, 10);
        else if (!strcmp(key, "call_costs") && !strcmp(value, "h100")) {
            memcpy(call_cost_us, H100_COST_US, sizeof call_cost_us);
            field_cost_us = 3;
            instant_field_us = 77;
        }
        else if (!strcmp(key, "call_costs") && !strcmp(value, "h200")) {
            memcpy(call_cost_us, H200_COST_US, sizeof call_cost_us);
            field_cost_us = 1;
            instant_field_us = 5;
        }
        else if (!strcmp(key, "call_cost_us")) parse_call_costs(value);
        else if (sscanf(key, "d%u.%n", &index, &used) == 1 && used && index < MAX_DEVICES)
            device_key(&devices[index], key + used, value);
    }
    fclose(file);
    return result;
}

/* ---- exported NVML entry points ---- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    nvmlReturn_t result = load_scenario();
    if (result != NVML_SUCCESS) return result;
    if (!initialised) {
        init_us = now_us();
        for (unsigned i = 0; i < device_count; i++) devices[i].init_energy = energy_to(&devices[i], init_us);
    }
    initialised++;
    return NVML_SUCCESS;
}

static void write_call_counts(void) {
    const char *path = getenv("FAKE_NVML_CALLS");
    if (!path) return;
    FILE *file = fopen(path, "w");
    if (!file) return;
    for (int i = 0; i < C_COUNT; i++) fprintf(file, "%s %llu\n", CALL_NAMES[i], call_count[i]);
    fclose(file);
}

/* Not NVML's: how many C calls an entry point has had, for a benchmark in the same process. */
unsigned long long fakeNvmlCallCount(const char *name) {
    for (int i = 0; i < C_COUNT; i++)
        if (!strcmp(name, CALL_NAMES[i])) return call_count[i];
    return 0;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    initialised--;
    if (!initialised) write_call_counts();
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = device_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (index >= device_count || !device) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!device || !index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = device->index;
    return NVML_SUCCESS;
}

/* The checks every device query starts with. */
#define DEVICE_CALL(device, out, bit, which)                               \
    do {                                                                   \
        called(which);                                                     \
        if (!initialised) return NVML_ERROR_UNINITIALIZED;                 \
        if (!(device) || !(out)) return NVML_ERROR_INVALID_ARGUMENT;       \
        if ((device)->unsupported & (bit)) return NVML_ERROR_NOT_SUPPORTED; \
        if ((device)->fail[which]) return (device)->fail[which];           \
    } while (0)

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    DEVICE_CALL(device, power, U_POWER_USAGE, C_POWER_USAGE);
    *power = power_average(device, now_us());
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy) {
    DEVICE_CALL(device, energy, U_ENERGY, C_ENERGY);
    *energy = energy_mj(device, now_us());
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int count, nvmlFieldValue_t *values) {
    DEVICE_CALL(device, values, 0, C_FIELD_VALUES);
    int energy_asked = 0, instant_asked = 0;
    for (int i = 0; i < count; i++)
        instant_asked |= values[i].fieldId == NVML_FI_DEV_POWER_INSTANT;
    for (int i = 0; i < count; i++)
        energy_asked |= values[i].fieldId == NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION ||
                        values[i].fieldId == NVML_FI_DEV_ENERGY;
    if (energy_asked) __atomic_add_fetch(&call_count[C_FIELD_ENERGY], 1, __ATOMIC_RELAXED);
    unsigned long long energy_field_us =
        call_cost_us[C_FIELD_ENERGY] ? call_cost_us[C_FIELD_ENERGY] : call_cost_us[C_ENERGY];
    spin(field_cost_us * (unsigned long long)(count > 0 ? count : 0) +
         (instant_asked ? instant_field_us : 0) + (energy_asked ? energy_field_us : 0));
    unsigned long long now = now_us();
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = (int64_t)now;
        v->latencyUsec = 0;
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        v->value.ullVal = 0;
        if (v->fieldId == NVML_FI_DEV_POWER_INSTANT && !(device->unsupported & U_POWER_INSTANT)) {
            v->value.uiVal = power_at(device, now);
            v->nvmlReturn = NVML_SUCCESS;
        } else if ((v->fieldId == NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION ||
                    v->fieldId == NVML_FI_DEV_ENERGY) && device->fail[C_ENERGY]) {
            v->nvmlReturn = (unsigned)device->fail[C_ENERGY];
        } else if ((v->fieldId == NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION ||
                    v->fieldId == NVML_FI_DEV_ENERGY) && !(device->unsupported & U_ENERGY)) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
            v->value.ullVal = energy_mj(device, now);
            v->nvmlReturn = NVML_SUCCESS;
        } else if (v->fieldId == NVML_FI_DEV_POWER_AVERAGE &&
                   !(device->unsupported & U_POWER_AVERAGE)) {
            v->value.uiVal = power_average(device, now);
            v->nvmlReturn = NVML_SUCCESS;
        } else {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    DEVICE_CALL(device, utilization, U_UTILIZATION, C_UTILIZATION);
    /* slicing: the engine's busy % over the newest utilisation sample period, as drivers do */
    unsigned long long now = now_us();
    utilization->gpu = device->slice_ms ? busy_percent(device, now - now % util_sample_us)
                                        : device->util_gpu;
    utilization->memory = device->util_mem;
    return NVML_SUCCESS;
}

static nvmlReturn_t clock_of(unsigned int type, unsigned int sm, unsigned int mem,
                             unsigned int *clock) {
    if (type == NVML_CLOCK_SM) *clock = sm;
    else if (type == NVML_CLOCK_MEM) *clock = mem;
    else return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, unsigned int type, unsigned int *clock) {
    DEVICE_CALL(device, clock, U_CLOCK, C_CLOCK);
    return clock_of(type, device->clock_sm, device->clock_mem, clock);
}

nvmlReturn_t nvmlDeviceGetApplicationsClock(nvmlDevice_t device, unsigned int type,
                                            unsigned int *clock) {
    DEVICE_CALL(device, clock, U_APP_CLOCK, C_APP_CLOCK);
    return clock_of(type, device->app_clock_sm, device->app_clock_mem, clock);
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    DEVICE_CALL(device, limit, U_POWER_LIMIT, C_POWER_LIMIT);
    *limit = device->power_limit;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerState(nvmlDevice_t device, unsigned int *pstate) {
    DEVICE_CALL(device, pstate, U_POWER_STATE, C_POWER_STATE);
    *pstate = device->pstate;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensor,
                                      unsigned int *temperature) {
    DEVICE_CALL(device, temperature, U_TEMPERATURE, C_TEMPERATURE);
    if (sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *temperature = device->temperature;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, unsigned int counter,
                                         unsigned int *value) {
    DEVICE_CALL(device, value, U_PCIE, C_PCIE);
    if (pcie_delay_us) {
        struct timespec pause = {(time_t)(pcie_delay_us / 1000000ULL),
                                 (long)(pcie_delay_us % 1000000ULL) * 1000L};
        nanosleep(&pause, NULL);
    }
    if (counter == NVML_PCIE_UTIL_TX_BYTES) *value = device->pcie_tx;
    else if (counter == NVML_PCIE_UTIL_RX_BYTES) *value = device->pcie_rx;
    else return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

/* Timestamps of the grid points newer than `after` still held in a buffer at `now`:
 * the first one and how many. */
static unsigned long long grid_window(unsigned long long period, unsigned long long after,
                                      unsigned long long now, unsigned long long *first) {
    unsigned long long newest = now - now % period;
    unsigned long long oldest = newest - (buffer_samples - 1) * period;
    unsigned long long start = after / period * period + period; /* first grid point > after */
    if (start < oldest) start = oldest;
    *first = start;
    return start > newest ? 0 : (newest - start) / period + 1;
}

/* The size query remembers its moment; the fill call right after answers for that moment. */
static unsigned long long moment(struct fake_device *device, int slot, int sizing) {
    if (sizing) return device->sizing_now_us[slot] = now_us();
    unsigned long long at = device->sizing_now_us[slot];
    device->sizing_now_us[slot] = 0;
    return at ? at : now_us();
}

/* The engine's busy % over the utilisation sample period that ends at t. */
static unsigned int busy_percent(const struct fake_device *d, unsigned long long t) {
    unsigned long long period_ms = util_sample_us / 1000ULL, end_ms = t / 1000ULL;
    if (!period_ms) return 0;
    return (unsigned int)(busy_ms(d, end_ms - period_ms, end_ms) * 100ULL / period_ms);
}

nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t device, unsigned int type,
                                  unsigned long long lastSeenTimeStamp,
                                  unsigned int *sampleValType, unsigned int *sampleCount,
                                  nvmlSample_t *samples) {
    static const unsigned bits[] = {U_SAMPLES_POWER, U_SAMPLES_UTIL, U_SAMPLES_MEM};
    if (type > NVML_MEMORY_UTILIZATION_SAMPLES) return NVML_ERROR_NOT_SUPPORTED;
    DEVICE_CALL(device, sampleCount, bits[type], C_SAMPLES_POWER + (int)type);
    if (!sampleValType) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long period = type == NVML_TOTAL_POWER_SAMPLES ? power_sample_us : util_sample_us;
    unsigned long long now = moment(device, (int)type, samples == NULL);
    unsigned long long first;
    unsigned long long available = grid_window(period, lastSeenTimeStamp, now, &first);
    *sampleValType = NVML_VALUE_TYPE_UNSIGNED_INT;
    if (available == 0) {
        device->sizing_now_us[type] = 0;
        *sampleCount = 0;
        return NVML_ERROR_NOT_FOUND;
    }
    if (!samples) {
        *sampleCount = (unsigned int)available;
        return NVML_SUCCESS;
    }
    unsigned int n = *sampleCount < available ? *sampleCount : (unsigned int)available;
    for (unsigned int i = 0; i < n; i++) {
        unsigned long long t = first + i * period;
        samples[i].timeStamp = t;
        samples[i].sampleValue.ullVal = 0;
        if (type == NVML_TOTAL_POWER_SAMPLES) samples[i].sampleValue.uiVal = power_at(device, t);
        else if (type == NVML_GPU_UTILIZATION_SAMPLES && device->slice_ms)
            samples[i].sampleValue.uiVal = busy_percent(device, t);
        else if (type == NVML_GPU_UTILIZATION_SAMPLES) samples[i].sampleValue.uiVal = device->util_gpu;
        else samples[i].sampleValue.uiVal = device->util_mem;
    }
    *sampleCount = n;
    return NVML_SUCCESS;
}

/* One entry per pid, as the driver gives them: what a pid got, summed over the samples newer
 * than `after`; `count` samples in all. Returns how many pids. */
typedef struct { unsigned int pid; unsigned long long sum, newest; } pid_total;

static int slice_totals(const struct fake_device *d, unsigned long long after,
                        unsigned long long now, pid_total *totals, unsigned long long *count) {
    unsigned long long first;
    *count = grid_window(util_sample_us, after, now, &first);
    int n = 0;
    for (unsigned long long i = 0; i < *count; i++) {
        unsigned long long t = first + i * util_sample_us;
        int busy = 0;
        unsigned int pid = resident(d, t / 1000ULL - 1, &busy); /* resident at the instant */
        if (!pid) continue;
        int j = 0;
        while (j < n && totals[j].pid != pid) j++;
        if (j == n) {
            if (n == MAX_SLOTS) continue;
            totals[n++] = (pid_total){pid, 0, 0};
        }
        totals[j].sum += busy_percent(d, t);
        totals[j].newest = t;
    }
    /* a pid whose samples all read 0 % had no "non-zero utilization": not listed */
    int kept = 0;
    for (int j = 0; j < n; j++)
        if (totals[j].sum) totals[kept++] = totals[j];
    return kept;
}

static nvmlReturn_t slice_processes(struct fake_device *device,
                                    nvmlProcessUtilizationSample_t *utilization,
                                    unsigned int *processSamplesCount,
                                    unsigned long long lastSeenTimeStamp) {
    unsigned long long now = moment(device, 3, utilization == NULL);
    pid_total totals[MAX_SLOTS];
    unsigned long long samples = 0;
    int n = slice_totals(device, lastSeenTimeStamp, now, totals, &samples);
    if (n == 0) {
        device->sizing_now_us[3] = 0;
        *processSamplesCount = 0;
        return NVML_ERROR_NOT_FOUND;
    }
    if (!utilization || *processSamplesCount < (unsigned)n) {
        *processSamplesCount = (unsigned)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    device->sizing_now_us[3] = 0;
    for (int j = 0; j < n; j++) {
        utilization[j] = (nvmlProcessUtilizationSample_t){
            .pid = totals[j].pid, .timeStamp = totals[j].newest,
            .smUtil = (unsigned)((totals[j].sum + samples / 2) / samples)};
    }
    *processSamplesCount = (unsigned)n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                             nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount,
                                             unsigned long long lastSeenTimeStamp) {
    DEVICE_CALL(device, processSamplesCount, U_PROCESSES, C_PROCESSES);
    if (device->mig) return NVML_ERROR_NOT_SUPPORTED;
    if (device->slice_ms)
        return slice_processes(device, utilization, processSamplesCount, lastSeenTimeStamp);
    unsigned long long now = moment(device, 3, utilization == NULL);
    unsigned long long first;
    unsigned long long points = device->procs ? grid_window(util_sample_us, lastSeenTimeStamp,
                                                            now, &first) : 0;
    unsigned long long available = points * (unsigned long long)device->procs;
    if (available == 0) {
        device->sizing_now_us[3] = 0;
        *processSamplesCount = 0;
        return NVML_ERROR_NOT_FOUND;
    }
    if (!utilization || *processSamplesCount < available) {
        *processSamplesCount = (unsigned int)available;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int n = 0;
    for (unsigned long long i = 0; i < points; i++) {
        for (int p = 0; p < device->procs; p++, n++) {
            utilization[n].pid = device->proc[p].pid;
            utilization[n].timeStamp = first + i * util_sample_us;
            utilization[n].smUtil = device->proc[p].sm;
            utilization[n].memUtil = device->proc[p].mem;
            utilization[n].encUtil = 0;
            utilization[n].decUtil = 0;
        }
    }
    *processSamplesCount = n;
    return NVML_SUCCESS;
}

/* ---- identity and MIG, for `wattflow check` ---- */

static nvmlReturn_t copy_text(const char *text, char *out, unsigned int length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, text);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    return copy_text("580.159.04-stand-in", version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    return copy_text("13.580.159.04-stand-in", version, length);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    return copy_text("NVML stand-in GPU", name, length);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!device || !current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = (unsigned)device->mig;
    return NVML_SUCCESS;
}

/* ---- MIG devices and GPM (Hopper's per-GPU-instance activity counters) ---- */

/* The GPU instance a MIG device handle points at; NULL for any other pointer. */
static struct fake_gi *gi_of_handle(const void *handle) {
    for (unsigned d = 0; d < device_count; d++)
        for (int i = 0; i < devices[d].gis; i++)
            if (handle == (const void *)&devices[d].gi[i]) return &devices[d].gi[i];
    return NULL;
}

static int gi_alive(const struct fake_gi *gi) {
    return !gi->until_us || now_us() < init_us + gi->until_us;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!device || !count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = device->mig ? MAX_GIS : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *mig_device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!device || !mig_device) return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->mig) return NVML_ERROR_NOT_SUPPORTED;
    unsigned alive = 0;
    for (int i = 0; i < device->gis; i++) {
        if (!gi_alive(&device->gi[i])) continue;
        if (alive++ == index) {
            *mig_device = (nvmlDevice_t)(void *)&device->gi[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    struct fake_gi *gi = gi_of_handle(device);
    if (!id) return NVML_ERROR_INVALID_ARGUMENT;
    if (!gi) return NVML_ERROR_NOT_SUPPORTED; /* a whole GPU, not a MIG device */
    *id = gi->id;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* The processes on a MIG device (its GPU instance's), or on a whole GPU (under MIG, every
 * instance's, as NVML aggregates them for a privileged caller; else the dN.proc pids). */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    called(C_RUNNING_PROCESSES);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!device || !count) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlProcessInfo_t found[MAX_GIS * MAX_PROCS + 2 * MAX_PROCS];
    unsigned n = 0;
    struct fake_gi *gi = gi_of_handle(device);
    if (gi && !gi_alive(gi)) return NVML_ERROR_NOT_FOUND;
    if (gi) {
        for (int p = 0; p < gi->procs; p++)
            found[n++] = (nvmlProcessInfo_t){gi->pid[p], 0, gi->id, 0};
    } else if (device->mig) {
        for (int i = 0; i < device->gis; i++)
            for (int p = 0; gi_alive(&device->gi[i]) && p < device->gi[i].procs; p++)
                found[n++] = (nvmlProcessInfo_t){device->gi[i].pid[p], 0, device->gi[i].id, 0};
    } else {
        for (int p = 0; p < device->procs; p++)
            found[n++] = (nvmlProcessInfo_t){device->proc[p].pid, 0, 0xFFFFFFFFu, 0xFFFFFFFFu};
        unsigned long long ms = now_us() / 1000ULL; /* the tenants alive now */
        for (int i = 0; !device->tenants && i < device->slots && n < MAX_PROCS; i++) {
            unsigned int pid = device->slot_pid[i]; /* the time-slicing pids alive now, once */
            int seen = 0;
            for (unsigned j = 0; j < n; j++) seen |= found[j].pid == pid;
            if (pid && !seen && alive(device, pid, ms))
                found[n++] = (nvmlProcessInfo_t){pid, 0, 0xFFFFFFFFu, 0xFFFFFFFFu};
        }
        for (int i = 0; i < device->tenants; i++) {
            const fake_tenant *t = &device->tenant[i];
            if (!t->to_ms || (ms >= t->from_ms && ms < t->to_ms))
                found[n++] = (nvmlProcessInfo_t){t->pid, 0, 0xFFFFFFFFu, 0xFFFFFFFFu};
        }
    }
    if (*count < n || (n && !infos)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n) memcpy(infos, found, n * sizeof found[0]);
    *count = n;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int version;
    unsigned int isSupportedDevice;
} nvmlGpmSupport_t;

nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *support) {
    called(C_GPM_SUPPORT);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!device || !support || support->version != 1) return NVML_ERROR_INVALID_ARGUMENT;
    support->isSupportedDevice = (unsigned)device->gpm;
    return NVML_SUCCESS;
}

/* What an opaque nvmlGpmSample_t holds here: the counters of one GPU instance at one moment,
 * as %·µs of activity since the Unix epoch (exact integers: shares are constant). */
struct fake_gpm_sample {
    const struct fake_device *device;
    unsigned int gi_id;
    unsigned long long t_us, graphics, sm;
    int taken;
};
typedef struct fake_gpm_sample *nvmlGpmSample_t;

nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *sample) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!sample) return NVML_ERROR_INVALID_ARGUMENT;
    *sample = calloc(1, sizeof **sample);
    return *sample ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t sample) {
    if (!sample) return NVML_ERROR_INVALID_ARGUMENT;
    free(sample);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t device, unsigned int gpu_instance_id,
                                 nvmlGpmSample_t sample) {
    DEVICE_CALL(device, sample, 0, C_GPM_SAMPLE);
    if (!device->gpm || !device->mig) return NVML_ERROR_NOT_SUPPORTED;
    for (int i = 0; i < device->gis; i++) {
        const struct fake_gi *gi = &device->gi[i];
        if (gi->id != gpu_instance_id || !gi_alive(gi)) continue;
        unsigned long long t = now_us();
        *sample = (struct fake_gpm_sample){device, gi->id, t, t * gi->graphics, t * gi->sm, 1};
        return NVML_SUCCESS;
    }
    return NVML_ERROR_NOT_FOUND;
}

typedef struct {
    const char *shortName, *longName, *unit;
} nvmlGpmMetricInfo_t;

typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    nvmlGpmMetricInfo_t metricInfo;
} nvmlGpmMetric_t;

typedef struct {
    unsigned int version;
    unsigned int numMetrics;
    nvmlGpmSample_t sample1, sample2;
    nvmlGpmMetric_t metrics[]; /* NVML_GPM_METRIC_MAX of them: only numMetrics are touched */
} nvmlGpmMetricsGet_t;

enum { NVML_GPM_METRIC_GRAPHICS_UTIL = 1, NVML_GPM_METRIC_SM_UTIL = 2 };

/* Each asked metric over (sample1, sample2]: the counters' growth over the time between them. */
nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *get) {
    called(C_GPM_METRICS);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!get || get->version != 1) return NVML_ERROR_INVALID_ARGUMENT;
    const struct fake_gpm_sample *a = get->sample1, *b = get->sample2;
    if (!a || !b || !a->taken || !b->taken || a->device != b->device || a->gi_id != b->gi_id ||
        b->t_us <= a->t_us)
        return NVML_ERROR_INVALID_ARGUMENT;
    double span = (double)(b->t_us - a->t_us);
    for (unsigned i = 0; i < get->numMetrics; i++) {
        nvmlGpmMetric_t *metric = &get->metrics[i];
        metric->nvmlReturn = NVML_SUCCESS;
        if (metric->metricId == NVML_GPM_METRIC_GRAPHICS_UTIL)
            metric->value = (double)(b->graphics - a->graphics) / span;
        else if (metric->metricId == NVML_GPM_METRIC_SM_UTIL)
            metric->value = (double)(b->sm - a->sm) / span;
        else
            metric->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
    }
    return NVML_SUCCESS;
}
