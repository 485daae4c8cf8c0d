/* A fixed-size ring buffer of bytes: the writer never blocks, the oldest bytes are overwritten. */
#include <stddef.h>
#include <string.h>

struct ring {
    unsigned char *data;
    size_t cap, head, len;
};

void ring_init(struct ring *r, unsigned char *storage, size_t cap)
{
    r->data = storage;
    r->cap = cap;
    r->head = r->len = 0;
}

void ring_push(struct ring *r, const unsigned char *src, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        r->data[(r->head + r->len) % r->cap] = src[i];
        if (r->len < r->cap)
            r->len++;
        else
            r->head = (r->head + 1) % r->cap;  /* full: drop the oldest byte */
    }
}

size_t ring_pop(struct ring *r, unsigned char *dst, size_t n)
{
    size_t k = n < r->len ? n : r->len;
    for (size_t i = 0; i < k; i++)
        dst[i] = r->data[(r->head + i) % r->cap];
    r->head = (r->head + k) % r->cap;
    r->len -= k;
    return k;
}
