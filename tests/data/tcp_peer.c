/*
 * A plain TCP program for tests/stream_interop.rs: BSD sockets and nothing of RDMA, so that only
 * LD_PRELOAD=librspreload.so makes its sockets rsockets.
 *
 *   tcp_peer client ADDR PORT IN OUT  connects, sends the file IN, shuts down its writing
 *                                     (shutdown(SHUT_WR)), reads to the end of the stream into
 *                                     the file OUT, prints "sent N received M"
 *   tcp_peer server ADDR PORT         listens, prints "listening on ADDR:PORT", accepts one
 *                                     connection, reads to its end, sends it all back, closes,
 *                                     prints "echoed N bytes"
 *
 * It asks for socket(AF_INET, SOCK_STREAM, 0) and calls accept() and read()/write(), which the
 * preload library turns into rsocket calls. (python3's and perl's sockets do not: they ask for
 * SOCK_STREAM | SOCK_CLOEXEC, which rsocket() refuses, so the preload library hands them a TCP
 * socket; and they accept with accept4(), which it does not intercept.)
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void die(const char *what)
{
	perror(what);
	exit(1);
}

static struct sockaddr_in addr_of(const char *ip, const char *port)
{
	struct sockaddr_in sin;

	memset(&sin, 0, sizeof sin);
	sin.sin_family = AF_INET;
	sin.sin_port = htons((unsigned short) atoi(port));
	if (inet_pton(AF_INET, ip, &sin.sin_addr) != 1) {
		fprintf(stderr, "not an IPv4 address: %s\n", ip);
		exit(2);
	}
	return sin;
}

static void send_all(int fd, const char *buf, size_t len)
{
	while (len) {
		ssize_t n = write(fd, buf, len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			die("write");
		buf += n;
		len -= (size_t) n;
	}
}

/* Reads to the end of the stream; returns the bytes (malloc'd) and their count in *len. */
static char *recv_all(int fd, size_t *len)
{
	size_t cap = 1 << 16, n = 0;
	char *buf = malloc(cap);

	if (!buf)
		die("malloc");
	for (;;) {
		ssize_t r;

		if (n == cap) {
			cap *= 2;
			buf = realloc(buf, cap);
			if (!buf)
				die("realloc");
		}
		r = read(fd, buf + n, cap - n);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			die("read");
		if (r == 0)
			break;
		n += (size_t) r;
	}
	*len = n;
	return buf;
}

static char *read_file(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	char *buf;
	long size;

	if (!f || fseek(f, 0, SEEK_END) || (size = ftell(f)) < 0 || fseek(f, 0, SEEK_SET))
		die(path);
	buf = malloc(size ? (size_t) size : 1);
	if (!buf)
		die("malloc");
	if (fread(buf, 1, (size_t) size, f) != (size_t) size)
		die(path);
	fclose(f);
	*len = (size_t) size;
	return buf;
}

static int client(const char *ip, const char *port, const char *in, const char *out)
{
	struct sockaddr_in sin = addr_of(ip, port);
	size_t len, back_len;
	char *data, *back;
	FILE *f;
	int fd;

	data = read_file(in, &len);
	fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0)
		die("socket");
	if (connect(fd, (struct sockaddr *) &sin, sizeof sin))
		die("connect");
	printf("connected to %s:%s\n", ip, port);
	fflush(stdout);
	send_all(fd, data, len);
	if (shutdown(fd, SHUT_WR))
		die("shutdown");
	back = recv_all(fd, &back_len);
	if (close(fd))
		die("close");
	f = fopen(out, "wb");
	if (!f || fwrite(back, 1, back_len, f) != back_len || fclose(f))
		die(out);
	printf("sent %zu received %zu\n", len, back_len);
	return 0;
}

static int server(const char *ip, const char *port)
{
	struct sockaddr_in sin = addr_of(ip, port);
	int lfd, fd, one = 1;
	size_t len;
	char *data;

	lfd = socket(AF_INET, SOCK_STREAM, 0);
	if (lfd < 0)
		die("socket");
	if (setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one))
		die("setsockopt");
	if (bind(lfd, (struct sockaddr *) &sin, sizeof sin))
		die("bind");
	if (listen(lfd, 1))
		die("listen");
	printf("listening on %s:%s\n", ip, port);
	fflush(stdout);
	fd = accept(lfd, NULL, NULL);
	if (fd < 0)
		die("accept");
	data = recv_all(fd, &len);
	send_all(fd, data, len);
	if (close(fd))
		die("close");
	close(lfd);
	printf("echoed %zu bytes\n", len);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 6 && !strcmp(argv[1], "client"))
		return client(argv[2], argv[3], argv[4], argv[5]);
	if (argc == 4 && !strcmp(argv[1], "server"))
		return server(argv[2], argv[3]);
	fprintf(stderr, "usage: %s client ADDR PORT IN OUT | server ADDR PORT\n", argv[0]);
	return 2;
}
