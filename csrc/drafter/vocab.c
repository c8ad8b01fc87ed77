// The drafter's tokenizer against its target's: the ids a drafter stores (mask token, d2t,
// and every token it was trained to propose) are the target's ids, so a drafter converted
// for another tokenizer drafts nonsense while its dimensions still match.  Upstream's
// converter copies the target's vocabulary into the drafter, as ours does; here it is
// required and compared, text by text (docs/architecture.md §4.5).
#include "drafter.h"

#include "common.h"

#include "gguf.h"
#include "llama.h"

#include <string.h>

#define FAIL(...) do { dflash_seterr(err, err_len, __VA_ARGS__); return false; } while (0)

static const char * const TOKENS_KEY = "tokenizer.ggml.tokens";

// Well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF): what a GGUF
// string must be, and what every reader of the token list (Python's too) decodes.
static bool utf8_ok(const unsigned char * s, size_t n) {
    size_t i = 0;
    while (i < n) {
        const unsigned c = s[i];
        size_t k;
        unsigned lo = 0x80, hi = 0xBF;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) k = 1;
        else if (c >= 0xE0 && c <= 0xEF) { k = 2; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
        else if (c >= 0xF0 && c <= 0xF4) { k = 3; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
        else return false;
        if (i + k >= n) return false; // truncated sequence
        for (size_t j = 1; j <= k; j++) {
            const unsigned b = s[i + j];
            if (j == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return false;
        }
        i += k + 1;
    }
    return true;
}

bool dflash_vocab_read(const struct gguf_context * g, const char * path, int32_t * n_tokens, char * err, size_t err_len) {
    const int64_t id = gguf_find_key(g, TOKENS_KEY);
    if (id < 0) FAIL("'%s': %s is missing (a drafter carries its target's vocabulary)", path, TOKENS_KEY);
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, id) != GGUF_TYPE_STRING) {
        FAIL("'%s': %s is not an array of strings", path, TOKENS_KEY);
    }
    const size_t n = gguf_get_arr_n(g, id);
    if (n < 1 || n > INT32_MAX) FAIL("'%s': %s holds %zu tokens", path, TOKENS_KEY, n);
    for (size_t i = 0; i < n; i++) {
        const char * s = gguf_get_arr_str(g, id, i);
        if (!utf8_ok((const unsigned char *) s, strlen(s))) FAIL("'%s': %s[%zu] is not valid UTF-8", path, TOKENS_KEY, i);
    }
    *n_tokens = (int32_t) n;
    return true;
}

// A token's text for a one-line message: at most 24 bytes, cut on a character boundary,
// control characters shown as '?'.
static const char * shown(char * buf, const char * s) {
    size_t n = 0;
    for (; s[n] && n < 24; n++) buf[n] = (unsigned char) s[n] < 0x20 || s[n] == 0x7f ? '?' : s[n];
    while (n > 0 && s[n] && ((unsigned char) s[n] & 0xC0) == 0x80) n--; // not inside a character
    buf[n] = 0;
    return buf;
}

bool dflash_vocab_match(const struct gguf_context * g, const struct llama_model * target, const char * path,
                        char * err, size_t err_len) {
    const struct llama_vocab * v = llama_model_get_vocab(target);
    const int32_t nt = llama_vocab_n_tokens(v);
    const int64_t id = gguf_find_key(g, TOKENS_KEY);
    const int32_t nd = (int32_t) gguf_get_arr_n(g, id);  // (dflash_vocab_read checked it)
    if (nd != nt) FAIL("drafter '%s' was made for another vocabulary: %s holds %d tokens, the target's %d", path, TOKENS_KEY, nd, nt);
    for (int32_t i = 0; i < nt; i++) {
        const char * a = gguf_get_arr_str(g, id, i), * b = llama_vocab_get_text(v, i);
        if (strcmp(a, b ? b : "") != 0) {
            char sa[32], sb[32];
            FAIL("drafter '%s' was made for another tokenizer: %s[%d] is \"%s\", the target's is \"%s\"", path,
                 TOKENS_KEY, i, shown(sa, a), shown(sb, b ? b : ""));
        }
    }
    return true;
}
