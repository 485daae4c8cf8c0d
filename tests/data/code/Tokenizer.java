package demo.text;

import java.util.ArrayList;
import java.util.List;

/** Splits a line into words and numbers, dropping punctuation. */
public final class Tokenizer {
    private Tokenizer() {}

    public static List<String> split(String line) {
        List<String> out = new ArrayList<>();
        StringBuilder current = new StringBuilder();
        for (char c : line.toCharArray()) {
            if (Character.isLetterOrDigit(c)) {
                current.append(c);
            } else if (current.length() > 0) {
                out.add(current.toString());
                current.setLength(0);
            }
        }
        if (current.length() > 0) {
            out.add(current.toString());
        }
        return out;
    }
}
