// Package lru is a least-recently-used cache with a fixed number of entries.
package lru

import "container/list"

type entry struct {
	key   string
	value any
}

// Cache evicts the least recently used entry when it is full.
type Cache struct {
	max   int
	order *list.List
	items map[string]*list.Element
}

// New returns a cache that holds at most max entries.
func New(max int) *Cache {
	return &Cache{max: max, order: list.New(), items: make(map[string]*list.Element)}
}

// Get returns the value for key and marks it as recently used.
func (c *Cache) Get(key string) (any, bool) {
	if el, ok := c.items[key]; ok {
		c.order.MoveToFront(el)
		return el.Value.(*entry).value, true
	}
	return nil, false
}

// Put stores value under key, evicting the oldest entry when the cache is full.
func (c *Cache) Put(key string, value any) {
	if el, ok := c.items[key]; ok {
		el.Value.(*entry).value = value
		c.order.MoveToFront(el)
		return
	}
	c.items[key] = c.order.PushFront(&entry{key, value})
	if c.order.Len() > c.max {
		oldest := c.order.Back()
		c.order.Remove(oldest)
		delete(c.items, oldest.Value.(*entry).key)
	}
}
