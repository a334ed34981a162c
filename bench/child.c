/*
 * bench child: the one program every supervisor under test runs.
 *
 *   child -s STAMPDIR [-d DELAY_MS] [-i] [-g] [-m MAX_SEC]
 *
 * -s  directory for timestamp files. Each file is created empty; its NAME
 *     carries the data, so a reader never sees a half-written file:
 *       s.<pid>.<ns>   this process started (CLOCK_MONOTONIC ns, taken first thing)
 *       t.<pid>.<ns>   this process received SIGTERM
 *       g.<pid>.<ns>   a grandchild (see -g) started
 * -d  after SIGTERM, exit after DELAY_MS milliseconds (default 0)
 * -i  ignore SIGTERM (still writes the t. stamp, keeps running)
 * -g  at start, double-fork a grandchild that calls setsid() (escapes the
 *     child's session and process group) and sleeps
 * -m  safety net: exit after MAX_SEC seconds whatever happens (default 3600);
 *     the grandchild gets the same limit. The harness kills everything by pid
 *     anyway; this only bounds the damage if the harness itself is SIGKILLed.
 *
 * With no argument at all, the arguments are read from the file ./args (one a
 * line): runit's runsv execs ./run with no arguments, and a shell script in
 * between would charge runit for a shell's exec on every spawn.
 *
 * Built static (gcc -O2 -static) so that exec is as cheap as it gets and the
 * spawn cost measured is the supervisor's, not the dynamic loader's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *stamp_dir = NULL;
static volatile sig_atomic_t got_term = 0;
static long long term_ns = 0;

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* async-signal-safe enough: snprintf is not formally, so the handler only
 * records the time; the stamp is written from the main loop. */
static void on_term(int sig)
{
    (void)sig;
    if (!got_term)
        term_ns = now_ns();
    got_term = 1;
}

static void stamp(char kind, long long ns)
{
    char path[4096];
    int fd;
    if (!stamp_dir)
        return;
    snprintf(path, sizeof path, "%s/%c.%d.%lld", stamp_dir, kind, (int)getpid(), ns);
    fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0)
        close(fd);
}

static void sleep_ms(long ms)
{
    struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
        ;
}

static sigset_t run_mask; /* the mask with SIGTERM deliverable */

/* argv from ./args, one argument a line (see the header); argv[0] is kept. */
static char args_buf[4096];
static char *args_argv[64];

static int args_from_file(char *argv0, char ***argv_out)
{
    int fd = open("args", O_RDONLY | O_CLOEXEC), argc = 1;
    ssize_t len;
    if (fd < 0)
        return 1;
    len = read(fd, args_buf, sizeof args_buf - 1);
    close(fd);
    if (len < 0)
        len = 0;
    args_buf[len] = 0;
    args_argv[0] = argv0;
    for (char *p = args_buf; *p && argc < 63; ) {
        char *nl = strchr(p, '\n');
        if (nl)
            *nl = 0;
        if (*p)
            args_argv[argc++] = p;
        if (!nl)
            break;
        p = nl + 1;
    }
    args_argv[argc] = NULL;
    *argv_out = args_argv;
    return argc;
}

static void spawn_grandchild(unsigned max_sec)
{
    pid_t p = fork();
    if (p < 0)
        return;
    if (p == 0) {
        /* intermediate: new session, fork the grandchild, exit */
        setsid();
        pid_t g = fork();
        if (g == 0) {
            long long t = now_ns();
            signal(SIGTERM, SIG_DFL);
            sigprocmask(SIG_SETMASK, &run_mask, NULL);
            alarm(max_sec);
            stamp('g', t);
            for (;;)
                pause();
        }
        _exit(0);
    }
    /* reap the intermediate */
    int st;
    while (waitpid(p, &st, 0) == -1 && errno == EINTR)
        ;
}

int main(int argc, char **argv)
{
    long long t0 = now_ns();
    long delay_ms = 0;
    int ignore = 0, grandchild = 0, opt;
    unsigned max_sec = 3600;
    sigset_t block, old;
    struct sigaction sa;

    if (argc == 1)
        argc = args_from_file(argv[0], &argv);
    while ((opt = getopt(argc, argv, "s:d:igm:")) != -1) {
        switch (opt) {
        case 's': stamp_dir = optarg; break;
        case 'd': delay_ms = atol(optarg); break;
        case 'i': ignore = 1; break;
        case 'g': grandchild = 1; break;
        case 'm': max_sec = (unsigned)atol(optarg); break;
        default:
            fprintf(stderr, "usage: %s -s DIR [-d MS] [-i] [-g] [-m SEC]\n", argv[0]);
            return 2;
        }
    }

    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_term;
    sigemptyset(&sa.sa_mask);
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigprocmask(SIG_BLOCK, &block, &old);
    run_mask = old;
    sigdelset(&run_mask, SIGTERM); /* whatever the supervisor left blocked */
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGALRM, SIG_DFL);
    alarm(max_sec);

    stamp('s', t0);
    if (grandchild)
        spawn_grandchild(max_sec);

    for (;;) {
        /* wait for SIGTERM with it unblocked only inside sigsuspend: no lost wakeup */
        while (!got_term)
            sigsuspend(&run_mask);
        stamp('t', term_ns);
        if (!ignore) {
            if (delay_ms > 0)
                sleep_ms(delay_ms);
            _exit(0);
        }
        got_term = 0;
    }
}
