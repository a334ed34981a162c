/* omnid.process._spawnc: the spawner's compiled path from fork to exec (called by omnid/process/spawnexec.py).
 *
 * One call does what the spawner's Python child (omnid/process/spawnchild.py: the same steps, in the
 * same order, and the words a failed stage reads as) does between fork and exec, in C, in a vfork
 * child: no interpreter runs in the child, so no copy-on-write fault and no page-table copy
 * of the spawner stand between a spawn request and the unit's exec.
 *
 *   setsid, PR_SET_PDEATHSIG (and the check that the spawner still lives), the signals
 *   reset to default and the mask emptied, stdio, every other fd closed, rlimits, the
 *   cgroup join, CPU affinity and memory policy, cwd, gid/groups/uid (armed PDEATHSIG again
 *   after the switch), execve through the candidates in order (execvpe's rules). With
 *   listening fds (omnid/process/sockets.py): those as fds 3, 4, ... and LISTEN_PID = the child's pid.
 *
 * Everything the child needs is prepared by the caller before vfork (C arrays, the cpu set,
 * the groups); the child makes system calls only. What failed, and why, the child writes
 * into the caller's memory (shared under vfork) before _exit(127): when vfork returns the
 * child has either exec'd or failed, so the spawner knows the outcome at once, without an
 * error pipe or another turn of its loop.
 *
 * Why vfork is safe here: the spawner is single-threaded (checked by the caller before every
 * spawn); every signal is blocked around vfork, and the child resets each handled or ignored
 * signal to default before it unblocks them, so no handler of the spawner ever runs in the
 * child; user and group changes use the raw system calls (glibc's setuid broadcasts to
 * threads through a lock); the child never returns from the function that called vfork.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#define MPOL_PREFERRED_MANY 5

/* The 32-bit id system calls where the plain ones take 16-bit ids (i386, arm). */
#ifdef SYS_setuid32
#define SYS_SETUID SYS_setuid32
#define SYS_SETGID SYS_setgid32
#define SYS_SETGROUPS SYS_setgroups32
#else
#define SYS_SETUID SYS_setuid
#define SYS_SETGID SYS_setgid
#define SYS_SETGROUPS SYS_setgroups
#endif

enum stage {
    ST_OK = 0,
    ST_SETSID,
    ST_PDEATHSIG,
    ST_SIGNALS,
    ST_STDIO,
    ST_RLIMIT,
    ST_CGROUP,
    ST_AFFINITY,
    ST_MEMPOLICY,
    ST_CHDIR,
    ST_GROUP,
    ST_USER,
    ST_PDEATHSIG_AGAIN,
    ST_EXEC,
    ST_ORPHANED,
    ST_LISTEN,
};

struct plan {
    char **candidates;
    Py_ssize_t ncandidates;
    char **argv;
    char **envp;
    int out_fd, err_fd, devnull;
    pid_t spawner_pid;
    long *reset;
    Py_ssize_t nreset;
    int *rl_res;
    struct rlimit *rl;
    Py_ssize_t nrl;
    const char *cgroup_procs;
    cpu_set_t *cpus;
    size_t cpus_size;
    long mp_mode;
    const unsigned long *mp_mask;
    unsigned long mp_maxnode;
    int mp_many_fallback;
    const char *cwd;
    long gid;
    gid_t *groups;
    Py_ssize_t ngroups; /* -1: leave the supplementary groups */
    long uid;
    int *listen; /* fds that become 3, 4, ... (systemd's LISTEN_FDS) */
    int *moved; /* scratch for the child: each listen fd moved above the ones it becomes */
    Py_ssize_t nlisten;
    char *listen_pid; /* "LISTEN_PID=" and room for the digits, the last entry of envp */
};

struct outcome {
    int stage;
    int err;
    int index;
};

static void __attribute__((noreturn)) fail(volatile struct outcome *o, int stage, int err, int index)
{
    o->stage = stage;
    o->err = err;
    o->index = index;
    _exit(127);
}

/* Test hook (_spawnc._walk_fds(True)): close by walking /proc/self/fd, as on a kernel
 * before 5.9 without close_range. */
static int force_fd_walk;

struct dirent64_raw {
    unsigned long long d_ino;
    long long d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

/* Close every fd from `lowest` up. close_range (Linux 5.9) where it is; else the fds that are
 * open, read from /proc/self/fd with getdents64 into a buffer on the stack (no malloc in a
 * vfork child); else, without /proc, every number below RLIMIT_NOFILE. */
static void close_from(int lowest)
{
#ifdef SYS_close_range
    if (!force_fd_walk && syscall(SYS_close_range, (unsigned int)lowest, ~0U, 0) == 0)
        return;
#endif
    int dir = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir >= 0) {
        char buf[4096] __attribute__((aligned(8)));
        long n;
        while ((n = syscall(SYS_getdents64, dir, buf, sizeof buf)) > 0) {
            for (long off = 0; off < n;) {
                struct dirent64_raw *d = (struct dirent64_raw *)(buf + off);
                off += d->d_reclen;
                long fd = 0;
                const char *c = d->d_name;
                if (*c < '0' || *c > '9')
                    continue; /* "." and ".." */
                for (; *c >= '0' && *c <= '9'; c++)
                    fd = fd * 10 + (*c - '0');
                if (fd >= lowest && fd != dir)
                    close((int)fd);
            }
        }
        close(dir);
        return;
    }
    struct rlimit nofile;
    long top = 65536;
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY)
        top = (long)nofile.rlim_cur;
    for (long fd = lowest; fd < top; fd++)
        close((int)fd);
}

static void __attribute__((noreturn, noinline)) child_exec(const struct plan *p, volatile struct outcome *o)
{
    if (setsid() < 0)
        fail(o, ST_SETSID, errno, 0);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
        fail(o, ST_PDEATHSIG, errno, 0);
    if (getppid() != p->spawner_pid) {
        /* The spawner died before PDEATHSIG was armed: it would never fire. */
        o->stage = ST_ORPHANED;
        _exit(1);
    }

    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    for (Py_ssize_t i = 0; i < p->nreset; i++)
        if (sigaction((int)p->reset[i], &dfl, NULL) < 0)
            fail(o, ST_SIGNALS, errno, (int)p->reset[i]);
    sigset_t none;
    sigemptyset(&none);
    if (sigprocmask(SIG_SETMASK, &none, NULL) < 0)
        fail(o, ST_SIGNALS, errno, 0);

    if (dup2(p->devnull, 0) < 0 || dup2(p->out_fd, 1) < 0 || dup2(p->err_fd, 2) < 0)
        fail(o, ST_STDIO, errno, 0);
    if (p->nlisten > 0) {
        /* Every listen fd moved above 3..top first (one may sit where another goes), then
         * each put in its place; dup2 leaves the new fd without close-on-exec. */
        int top = 3 + (int)p->nlisten;
        for (Py_ssize_t i = 0; i < p->nlisten; i++)
            if ((p->moved[i] = fcntl(p->listen[i], F_DUPFD_CLOEXEC, top)) < 0)
                fail(o, ST_LISTEN, errno, (int)i);
        for (Py_ssize_t i = 0; i < p->nlisten; i++)
            if (dup2(p->moved[i], 3 + (int)i) < 0)
                fail(o, ST_LISTEN, errno, (int)i);
        /* LISTEN_PID is this child's own pid (not the caller's: vfork shares its memory, and
         * the buffer is the caller's, written before exec), so a grandchild knows the fds are
         * not its own. The raw system call: no libc pid cache in a vfork child. */
        char digits[24];
        int n = 0;
        for (long v = (long)syscall(SYS_getpid); v > 0 && n < (int)sizeof digits; v /= 10)
            digits[n++] = (char)('0' + v % 10);
        char *at = p->listen_pid + sizeof "LISTEN_PID=" - 1;
        while (n > 0)
            *at++ = digits[--n];
        *at = 0;
        close_from(top);
    } else {
        close_from(3);
    }

    for (Py_ssize_t i = 0; i < p->nrl; i++)
        if (setrlimit(p->rl_res[i], &p->rl[i]) < 0)
            fail(o, ST_RLIMIT, errno, (int)i);

    if (p->cgroup_procs) {
        int fd = open(p->cgroup_procs, O_WRONLY | O_CLOEXEC);
        if (fd < 0)
            fail(o, ST_CGROUP, errno, 0);
        if (write(fd, "0", 1) != 1)
            fail(o, ST_CGROUP, errno, 0);
        close(fd);
    }
    if (p->cpus && sched_setaffinity(0, p->cpus_size, p->cpus) < 0)
        fail(o, ST_AFFINITY, errno, 0);
    if (p->mp_mode && syscall(SYS_set_mempolicy, p->mp_mode, p->mp_mask, p->mp_maxnode) != 0) {
        /* A kernel before 5.15 has no MPOL_PREFERRED_MANY: the affinity alone places it. */
        if (!(p->mp_many_fallback && p->mp_mode == MPOL_PREFERRED_MANY && errno == EINVAL))
            fail(o, ST_MEMPOLICY, errno, 0);
    }
    if (p->cwd && chdir(p->cwd) < 0)
        fail(o, ST_CHDIR, errno, 0);
    if (p->gid >= 0 && syscall(SYS_SETGID, (gid_t)p->gid) != 0)
        fail(o, ST_GROUP, errno, 0); /* the unit's group, or its user's primary group */
    if (p->ngroups >= 0 && syscall(SYS_SETGROUPS, (size_t)p->ngroups, p->groups) != 0)
        fail(o, ST_USER, errno, 0);
    if (p->uid >= 0 && syscall(SYS_SETUID, (uid_t)p->uid) != 0)
        fail(o, ST_USER, errno, 0);
    if (p->uid >= 0 || p->gid >= 0) {
        /* The kernel clears PDEATHSIG when credentials change: arm it again. */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
            fail(o, ST_PDEATHSIG_AGAIN, errno, 0);
        if (getppid() != p->spawner_pid) {
            o->stage = ST_ORPHANED;
            _exit(1);
        }
    }

    /* execvpe's rules: go on through every candidate; report the first error that is not
     * "not there", else the last one. */
    int first_err = 0, first_index = 0, last_err = ENOENT, last_index = 0;
    for (Py_ssize_t i = 0; i < p->ncandidates; i++) {
        execve(p->candidates[i], p->argv, p->envp);
        last_err = errno;
        last_index = (int)i;
        if (last_err != ENOENT && last_err != ENOTDIR && first_err == 0) {
            first_err = last_err;
            first_index = (int)i;
        }
    }
    if (first_err)
        fail(o, ST_EXEC, first_err, first_index);
    fail(o, ST_EXEC, last_err, last_index);
}

/* -- building the plan (in the caller, before vfork) ------------------------------------- */

struct arena {
    void **blocks;
    Py_ssize_t n, cap;
};

static void *arena_alloc(struct arena *a, size_t size)
{
    if (a->n == a->cap) {
        Py_ssize_t cap = a->cap ? a->cap * 2 : 16;
        void **blocks = PyMem_Realloc(a->blocks, (size_t)cap * sizeof *blocks);
        if (!blocks)
            return PyErr_NoMemory();
        a->blocks = blocks;
        a->cap = cap;
    }
    void *block = PyMem_Calloc(1, size ? size : 1);
    if (!block)
        return PyErr_NoMemory();
    a->blocks[a->n++] = block;
    return block;
}

static void arena_free(struct arena *a)
{
    for (Py_ssize_t i = 0; i < a->n; i++)
        PyMem_Free(a->blocks[i]);
    PyMem_Free(a->blocks);
}

/* A NULL-terminated array of C strings from a sequence of bytes (no NUL inside). */
static char **cstrings(struct arena *a, PyObject *seq, const char *what, Py_ssize_t *count)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    char **out = arena_alloc(a, (size_t)(n + 1) * sizeof(char *));
    if (!out)
        goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        char *s;
        Py_ssize_t len;
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyBytes_Check(item)) {
            PyErr_Format(PyExc_TypeError, "%s: item %zd is not bytes", what, i);
            goto error;
        }
        if (PyBytes_AsStringAndSize(item, &s, &len) < 0)
            goto error;
        if ((Py_ssize_t)strlen(s) != len) {
            PyErr_Format(PyExc_ValueError, "%s: item %zd has an embedded null byte", what, i);
            goto error;
        }
        out[i] = s; /* borrowed: the caller keeps the sequence alive for the call */
    }
    if (count)
        *count = n;
    Py_DECREF(fast);
    return out;
error:
    Py_DECREF(fast);
    return NULL;
}

static int ints(struct arena *a, PyObject *seq, const char *what, long **out, Py_ssize_t *count)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    long *values = arena_alloc(a, (size_t)(n ? n : 1) * sizeof(long));
    if (!values) {
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        values[i] = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (values[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    *out = values;
    *count = n;
    return 0;
}

PyDoc_STRVAR(spawn_doc,
"spawn(candidates, argv, envp, out_fd, err_fd, devnull, spawner_pid, reset_signals, rlimits,\n"
"      cgroup_procs, cpus, mp_mode, mp_mask, mp_maxnode, mp_many_fallback, cwd, gid, groups, uid\n"
"      [, listen])\n"
"    -> (pid, stage, errno, index)\n\n"
"vfork a child that sets itself up and execs the first candidate that runs. When this\n"
"returns, the child has exec'd (stage 0) or failed at `stage` with `errno` (it exits 127;\n"
"`index`: which rlimit, signal or candidate). bytes for paths and strings; rlimits a\n"
"sequence of (resource, soft, hard); cpus a sequence of CPU numbers or None; mp_mask the\n"
"nodemask as bytes; cgroup_procs and cwd bytes or None; gid and uid -1 to leave them;\n"
"groups a sequence of gids, or None to leave the supplementary groups; listen a sequence of\n"
"fds the child gets as 3, 4, ... with LISTEN_PID=<its pid> added to envp.");

static PyObject *spawn(PyObject *self, PyObject *args)
{
    PyObject *candidates, *argv, *envp, *reset, *rlimits, *cgroup_procs, *cpus, *mp_mask, *cwd, *groups;
    PyObject *listen = Py_None;
    int out_fd, err_fd, devnull, spawner_pid, mp_many_fallback;
    long mp_mode, gid, uid;
    unsigned long mp_maxnode;
    if (!PyArg_ParseTuple(args, "OOOiiiiOOOOlOkpOlOl|O:spawn", &candidates, &argv, &envp, &out_fd, &err_fd,
                          &devnull, &spawner_pid, &reset, &rlimits, &cgroup_procs, &cpus, &mp_mode,
                          &mp_mask, &mp_maxnode, &mp_many_fallback, &cwd, &gid, &groups, &uid, &listen))
        return NULL;

    struct arena a = {0};
    struct plan p;
    memset(&p, 0, sizeof p);
    PyObject *result = NULL;
    long *values;
    Py_ssize_t n;

    if (!(p.candidates = cstrings(&a, candidates, "candidates", &p.ncandidates)))
        goto done;
    if (p.ncandidates == 0) {
        PyErr_SetString(PyExc_ValueError, "no program to exec");
        goto done;
    }
    Py_ssize_t nenv = 0;
    if (!(p.argv = cstrings(&a, argv, "argv", NULL)) || !(p.envp = cstrings(&a, envp, "envp", &nenv)))
        goto done;
    if (listen != Py_None) {
        if (ints(&a, listen, "listen", &values, &n) < 0)
            goto done;
        if (n > 0) {
            if (n > 1000) {
                PyErr_SetString(PyExc_ValueError, "listen: more than 1000 fds");
                goto done;
            }
            p.nlisten = n;
            if (!(p.listen = arena_alloc(&a, (size_t)n * sizeof(int))) ||
                !(p.moved = arena_alloc(&a, (size_t)n * sizeof(int))) ||
                !(p.listen_pid = arena_alloc(&a, sizeof "LISTEN_PID=" + 24)))
                goto done;
            for (Py_ssize_t i = 0; i < n; i++) {
                if (values[i] < 0 || values[i] > 0x7fffffffL) {
                    PyErr_Format(PyExc_ValueError, "listen: %ld is not an fd", values[i]);
                    goto done;
                }
                p.listen[i] = (int)values[i];
            }
            memcpy(p.listen_pid, "LISTEN_PID=", sizeof "LISTEN_PID=");
            char **env2 = arena_alloc(&a, (size_t)(nenv + 2) * sizeof(char *));
            if (!env2)
                goto done;
            memcpy(env2, p.envp, (size_t)nenv * sizeof(char *));
            env2[nenv] = p.listen_pid; /* the child writes its pid into it */
            env2[nenv + 1] = NULL;
            p.envp = env2;
        }
    }
    if (p.argv[0] == NULL) {
        PyErr_SetString(PyExc_ValueError, "argv is empty");
        goto done;
    }
    p.out_fd = out_fd;
    p.err_fd = err_fd;
    p.devnull = devnull;
    p.spawner_pid = spawner_pid;

    if (ints(&a, reset, "reset_signals", &p.reset, &p.nreset) < 0)
        goto done;

    PyObject *rl_fast = PySequence_Fast(rlimits, "rlimits");
    if (!rl_fast)
        goto done;
    p.nrl = PySequence_Fast_GET_SIZE(rl_fast);
    p.rl_res = arena_alloc(&a, (size_t)(p.nrl ? p.nrl : 1) * sizeof(int));
    p.rl = arena_alloc(&a, (size_t)(p.nrl ? p.nrl : 1) * sizeof(struct rlimit));
    if (!p.rl_res || !p.rl) {
        Py_DECREF(rl_fast);
        goto done;
    }
    for (Py_ssize_t i = 0; i < p.nrl; i++) {
        int res;
        long long soft, hard;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(rl_fast, i), "iLL:rlimit", &res, &soft, &hard)) {
            Py_DECREF(rl_fast);
            goto done;
        }
        p.rl_res[i] = res;
        p.rl[i].rlim_cur = soft < 0 ? RLIM_INFINITY : (rlim_t)soft;
        p.rl[i].rlim_max = hard < 0 ? RLIM_INFINITY : (rlim_t)hard;
    }
    Py_DECREF(rl_fast);

    if (cgroup_procs != Py_None) {
        if (!PyBytes_Check(cgroup_procs)) {
            PyErr_SetString(PyExc_TypeError, "cgroup_procs must be bytes or None");
            goto done;
        }
        p.cgroup_procs = PyBytes_AS_STRING(cgroup_procs);
    }
    if (cpus != Py_None) {
        if (ints(&a, cpus, "cpus", &values, &n) < 0)
            goto done;
        if (n > 0) {
            long top = 0;
            for (Py_ssize_t i = 0; i < n; i++) {
                if (values[i] < 0 || values[i] > (1L << 20)) {
                    PyErr_Format(PyExc_ValueError, "cpus: %ld is not a CPU number", values[i]);
                    goto done;
                }
                if (values[i] > top)
                    top = values[i];
            }
            p.cpus_size = CPU_ALLOC_SIZE(top + 1);
            if (!(p.cpus = arena_alloc(&a, p.cpus_size)))
                goto done;
            for (Py_ssize_t i = 0; i < n; i++)
                CPU_SET_S((size_t)values[i], p.cpus_size, p.cpus);
        }
    }
    p.mp_mode = mp_mode;
    if (mp_mode) {
        char *mask;
        Py_ssize_t len;
        if (!PyBytes_Check(mp_mask) || PyBytes_AsStringAndSize(mp_mask, &mask, &len) < 0) {
            PyErr_SetString(PyExc_TypeError, "mp_mask must be bytes");
            goto done;
        }
        if ((unsigned long)len * 8 + 1 < mp_maxnode) {
            PyErr_SetString(PyExc_ValueError, "mp_maxnode is beyond the mask");
            goto done;
        }
        unsigned long *copy = arena_alloc(&a, (size_t)len + sizeof(unsigned long));
        if (!copy)
            goto done;
        memcpy(copy, mask, (size_t)len);
        p.mp_mask = copy;
        p.mp_maxnode = mp_maxnode;
        p.mp_many_fallback = mp_many_fallback;
    }
    if (cwd != Py_None) {
        if (!PyBytes_Check(cwd)) {
            PyErr_SetString(PyExc_TypeError, "cwd must be bytes or None");
            goto done;
        }
        p.cwd = PyBytes_AS_STRING(cwd);
    }
    p.gid = gid;
    p.uid = uid;
    p.ngroups = -1;
    if (groups != Py_None) {
        if (ints(&a, groups, "groups", &values, &n) < 0)
            goto done;
        if (!(p.groups = arena_alloc(&a, (size_t)(n ? n : 1) * sizeof(gid_t))))
            goto done;
        for (Py_ssize_t i = 0; i < n; i++)
            p.groups[i] = (gid_t)values[i];
        p.ngroups = n;
    }

    /* Every signal blocked from here until vfork returns: no handler of ours in the child. */
    sigset_t all, saved;
    sigfillset(&all);
    if ((errno = pthread_sigmask(SIG_SETMASK, &all, &saved)) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    volatile struct outcome o = {ST_OK, 0, 0};
    pid_t pid = vfork();
    if (pid == 0)
        child_exec(&p, &o);
    int fork_errno = errno;
    pthread_sigmask(SIG_SETMASK, &saved, NULL);
    if (pid < 0) {
        errno = fork_errno;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_BuildValue("(iiii)", (int)pid, o.stage, o.err, o.index);
done:
    arena_free(&a);
    return result;
}

static PyObject *walk_fds(PyObject *self, PyObject *arg)
{
    force_fd_walk = PyObject_IsTrue(arg) == 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"spawn", spawn, METH_VARARGS, spawn_doc},
    {"_walk_fds", walk_fds, METH_O, "Test hook: close a child's fds by walking /proc/self/fd (as without close_range)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_spawnc",
    "The spawner's compiled path from fork to exec (vfork; see omnid/process/spawner.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__spawnc(void)
{
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
#define STAGE(name) \
    if (PyModule_AddIntConstant(m, #name, name) < 0) { Py_DECREF(m); return NULL; }
    STAGE(ST_OK) STAGE(ST_SETSID) STAGE(ST_PDEATHSIG) STAGE(ST_SIGNALS) STAGE(ST_STDIO)
    STAGE(ST_RLIMIT) STAGE(ST_CGROUP) STAGE(ST_AFFINITY) STAGE(ST_MEMPOLICY) STAGE(ST_CHDIR)
    STAGE(ST_GROUP) STAGE(ST_USER) STAGE(ST_PDEATHSIG_AGAIN) STAGE(ST_EXEC) STAGE(ST_ORPHANED) STAGE(ST_LISTEN)
#undef STAGE
    return m;
}
