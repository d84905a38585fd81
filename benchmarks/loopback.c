// loopback.c: what plain TCP on 127.0.0.1 carries between two processes (no library at all).
//
//   cc -O2 -pthread -o loopback benchmarks/loopback.c
//   ./loopback one BYTES SOCKBUF [SPAN]     -> GB/s, one stream one way
//   ./loopback two BYTES SOCKBUF [SPAN]     -> GB/s each way, both directions at once (mean of the two)
//   ./loopback duplex BYTES SOCKBUF [SPAN]  -> the same, one thread per process
//   ./loopback rtt ROUNDS SOCKBUF           -> median 8-byte round trip in microseconds
//
// Built and run by benchmarks/loopback.py (which falls back to Python sockets without a C
// compiler). The process forks: the parent listens, the child connects.
//   two     each side sends on one connection from its main thread and receives on the other
//           from a second thread (blocking sockets), like a ring rank talking to its right and
//           left neighbours.
//   duplex  the same traffic from ONE thread per process: non-blocking sockets, each pass
//           writes and reads whatever the kernel takes, a 50 us spin and then poll() when
//           nothing moved. This is how a collective library drives a ring (pycyxwiz's TCP
//           transport does), and it uses at most one core per process, which is what makes the
//           figure a per-rank ceiling on a machine with fewer cores than ranks.
// Calls move kChunk bytes. SPAN (default kChunk) is the buffer they walk through: kChunk keeps
// the data in cache, 64 MiB makes every byte come from and go to memory, as in a large
// all-reduce. SOCKBUF 0 keeps the kernel's autotuned buffers; otherwise SO_SNDBUF/SO_RCVBUF
// are set to it. LOOPBACK_CC in the environment names a congestion control (reno, ...) for every
// socket; unset, the machine's.
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { kChunk = 1 << 20 };
static int sockbuf;
static long span = kChunk;

static void die(const char* what) { perror(what); exit(1); }

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int tuned_socket(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  if (fd < 0) die("socket");
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  const char* cc = getenv("LOOPBACK_CC");  // a congestion control, else the machine's
  if (cc && *cc && setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, strlen(cc)) != 0) die("TCP_CONGESTION");
  if (sockbuf) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sockbuf, sizeof sockbuf);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sockbuf, sizeof sockbuf);
  }
  return fd;
}

// The next call's place in a span-sized buffer: kChunk pieces, wrapping around.
static long at(long done) { return done % span; }
static long piece(long done, long left) {
  long n = kChunk - done % kChunk;  // stay inside one kChunk piece of the span
  return n < left ? n : left;
}

static char* span_buffer(void) {
  char* buf = malloc(span);
  if (!buf) die("malloc");
  memset(buf, 1, span);
  return buf;
}

static void send_all(int fd, long total) {
  char* buf = span_buffer();
  for (long done = 0; done < total;) {
    ssize_t n = send(fd, buf + at(done), piece(done, total - done), 0);
    if (n < 0) { if (errno == EINTR) continue; die("send"); }
    done += n;
  }
  free(buf);
}

// Seconds from the first byte received to the last.
static double recv_all(int fd, long total) {
  char* buf = span_buffer();
  double t0 = 0;
  for (long got = 0; got < total;) {
    ssize_t n = recv(fd, buf + at(got), piece(got, total - got), 0);
    if (n <= 0) { if (n < 0 && errno == EINTR) continue; die("recv"); }
    if (got == 0) t0 = now();
    got += n;
  }
  free(buf);
  return now() - t0;
}

static void recv_exact(int fd, char* p, int n) {
  while (n > 0) {
    ssize_t k = recv(fd, p, n, 0);
    if (k <= 0) { if (k < 0 && errno == EINTR) continue; die("recv"); }
    p += k; n -= k;
  }
}

struct Recv { int fd; long total; double seconds; };
static void* recv_thread(void* p) {
  struct Recv* r = p;
  r->seconds = recv_all(r->fd, r->total);
  return NULL;
}

// One thread: send `total` on `out` and receive `total` on `in`, both non-blocking.
// Returns the seconds from the first byte moved to the last.
static double duplex(int out, int in, long total) {
  char* sbuf = span_buffer();
  char* rbuf = span_buffer();
  long sent = 0, got = 0;
  double t0 = 0, spin_until = 0;
  while (sent < total || got < total) {
    int moved = 0;
    if (sent < total) {
      ssize_t n = send(out, sbuf + at(sent), piece(sent, total - sent), MSG_DONTWAIT);
      if (n > 0) { sent += n; moved = 1; }
      else if (n < 0 && errno != EAGAIN && errno != EINTR) die("send");
    }
    if (got < total) {
      ssize_t n = recv(in, rbuf + at(got), piece(got, total - got), MSG_DONTWAIT);
      if (n > 0) { got += n; moved = 1; }
      else if (n == 0 || (errno != EAGAIN && errno != EINTR)) die("recv");
    }
    double t = now();
    if (moved) {
      if (t0 == 0) t0 = t;
      spin_until = t + 50e-6;
    } else if (t > spin_until) {
      struct pollfd f[2] = {{out, sent < total ? POLLOUT : 0, 0}, {in, got < total ? POLLIN : 0, 0}};
      poll(f, 2, 100);
    }
  }
  free(sbuf);
  free(rbuf);
  return now() - t0;
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    fprintf(stderr, "usage: %s one|two|duplex|rtt BYTES|ROUNDS SOCKBUF [SPAN]\n", argv[0]);
    return 2;
  }
  const char* mode = argv[1];
  long total = atol(argv[2]);
  sockbuf = atoi(argv[3]);
  if (argc == 5) span = atol(argv[4]) / kChunk * kChunk;
  if (span < kChunk) span = kChunk;

  int lfd = tuned_socket();
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(lfd, (struct sockaddr*)&a, sizeof a) || listen(lfd, 4)) die("bind/listen");
  socklen_t len = sizeof a;
  getsockname(lfd, (struct sockaddr*)&a, &len);
  int report[2];
  if (pipe(report)) die("pipe");

  pid_t pid = fork();
  if (pid < 0) die("fork");
  if (pid == 0) {  // child: connect, then play the other side
    int c1 = tuned_socket();
    if (connect(c1, (struct sockaddr*)&a, sizeof a)) die("connect");
    if (!strcmp(mode, "one")) {
      send_all(c1, total);
      char ack;
      recv_exact(c1, &ack, 1);
    } else if (!strcmp(mode, "two")) {
      int c2 = tuned_socket();
      if (connect(c2, (struct sockaddr*)&a, sizeof a)) die("connect");
      struct Recv r = {c2, total, 0};
      pthread_t t;
      pthread_create(&t, NULL, recv_thread, &r);
      send_all(c1, total);
      pthread_join(t, NULL);
      if (write(report[1], &r.seconds, sizeof r.seconds) != sizeof r.seconds) die("write");
    } else if (!strcmp(mode, "duplex")) {
      int c2 = tuned_socket();
      if (connect(c2, (struct sockaddr*)&a, sizeof a)) die("connect");
      fcntl(c1, F_SETFL, O_NONBLOCK);
      fcntl(c2, F_SETFL, O_NONBLOCK);
      double secs = duplex(c1, c2, total);
      if (write(report[1], &secs, sizeof secs) != sizeof secs) die("write");
    } else {
      char b[8];
      for (long i = 0; i < total; ++i) { recv_exact(c1, b, 8); send(c1, b, 8, 0); }
    }
    _exit(0);
  }

  int s1 = accept(lfd, NULL, NULL);
  if (s1 < 0) die("accept");
  if (!strcmp(mode, "one")) {
    double secs = recv_all(s1, total);
    send(s1, "k", 1, 0);
    printf("%.6f\n", total / secs / 1e9);
  } else if (!strcmp(mode, "two")) {
    int s2 = accept(lfd, NULL, NULL);
    if (s2 < 0) die("accept");
    struct Recv r = {s1, total, 0};
    pthread_t t;
    pthread_create(&t, NULL, recv_thread, &r);
    send_all(s2, total);
    pthread_join(t, NULL);
    double theirs;
    if (read(report[0], &theirs, sizeof theirs) != sizeof theirs) die("read");
    printf("%.6f\n", (total / r.seconds + total / theirs) / 2 / 1e9);
  } else if (!strcmp(mode, "duplex")) {
    int s2 = accept(lfd, NULL, NULL);
    if (s2 < 0) die("accept");
    fcntl(s1, F_SETFL, O_NONBLOCK);
    fcntl(s2, F_SETFL, O_NONBLOCK);
    double mine = duplex(s2, s1, total), theirs;
    if (read(report[0], &theirs, sizeof theirs) != sizeof theirs) die("read");
    printf("%.6f\n", (total / mine + total / theirs) / 2 / 1e9);
  } else {
    double* rt = malloc(sizeof(double) * total);
    char b[8] = {0};
    for (long i = 0; i < total; ++i) {
      double t0 = now();
      send(s1, b, 8, 0);
      recv_exact(s1, b, 8);
      rt[i] = now() - t0;
    }
    qsort(rt, total, sizeof *rt, cmp_double);
    printf("%.3f\n", rt[total / 2] * 1e6);
  }
  int status;
  waitpid(pid, &status, 0);
  return 0;
}
