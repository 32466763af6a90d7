"""A small built-in English corpus for training the tiny tokenizers offline.

The tiny models of the embedded default (docs/architecture.md §10) need tokenizers, and there is no hub to
download one from, so :mod:`paco.models.tokenizers` trains them on this corpus. It covers what
the pipeline feeds a tokenizer: image-set prompts (subjects, styles, settings), grid panel tags
(``[TOP]``, ``[TOP-LEFT]`` ...), numbers and punctuation, two of the judge's prompt templates
(frozen copies), its answer words ``Yes`` / ``No`` and the ``<reason>1. ... 2. ...</reason>``
phrasing.

Everything here is a constant or built from constants in a fixed order, so
:func:`corpus_lines` returns the same list on every call, machine and Python version (no
hashing, no randomness) and the trained tokenizers are reproducible.
"""

from __future__ import annotations

# The template texts the tiny tokenizers were trained on: frozen copies of
# ``paco.core.templates.T2IS_THEME.text`` and ``CRITERIA_COT.text`` as they were when the tiny
# models were defined. Rewording a judge template later does not retrain the tokenizers (nor
# rebuild the models: this module imports no template); a byte-level BPE encodes any text.
# tests/test_models.py checks that the current templates still encode into few tokens.

#: The pairwise consistency prompt of PaCo-Reward (paper §3.1), frozen (see above).
PAIRWISE_TEMPLATE = (
    'Given two subfigures generated based on the theme: "{main_prompt}", do the two images '
    'maintain consistency in terms of style, logic and identity? Answer "Yes" and "No" first, '
    "and then provide detailed reasons."
)

#: The criteria prompt (prompt-image alignment), frozen (see above).
CRITERIA_TEMPLATE = (
    "Do images meet the following criteria? {criteria} Please answer Yes or No first, then "
    "provide detailed reasons."
)

#: Grid panel tags used in FLUX grid prompts.
PANEL_TAGS = (
    "[TOP]", "[BOTTOM]", "[LEFT]", "[RIGHT]", "[CENTER]", "[MIDDLE]",
    "[TOP-LEFT]", "[TOP-RIGHT]", "[TOP-CENTER]", "[BOTTOM-LEFT]", "[BOTTOM-RIGHT]",
    "[BOTTOM-CENTER]", "[MIDDLE-LEFT]", "[MIDDLE-RIGHT]",
)

_PROMPTS = """\
A four-panel image set of the same red fox walking through a snowy forest at dawn.
A 2x2 grid showing one astronaut in four poses on the surface of the moon.
A cute orange cat wearing a tiny blue hat, drawn in a watercolor style.
A young woman with short black hair reading a book in a quiet library.
An old man with a grey beard and a green coat standing by the sea.
A small wooden boat floating on a calm lake under a pink sunset sky.
A futuristic city at night with neon lights, flying cars and tall glass towers.
A bowl of fresh fruit on a kitchen table: apples, oranges, bananas and grapes.
A golden retriever puppy playing with a yellow ball in a green garden.
A medieval castle on a hill surrounded by mountains and clouds.
A rocket launching into a clear blue sky with smoke and fire below it.
A cup of hot coffee with latte art on a white saucer, close-up photo.
A portrait of a girl with curly brown hair and freckles, oil painting.
A cartoon robot with round eyes and silver arms waving hello.
A steam train crossing a stone bridge over a deep valley in autumn.
A field of sunflowers under a bright summer sun, wide angle shot.
A knight in shining armor riding a white horse across a meadow.
A lighthouse on a rocky coast during a storm with big waves.
A panda eating bamboo in a misty forest, soft light, high detail.
A chef cooking pasta in a busy restaurant kitchen, warm colors.
A little boy flying a kite on a windy beach, photo realistic.
A dragon with blue scales sleeping on a pile of gold coins.
A snowman with a carrot nose and a red scarf in a winter village.
An owl sitting on a branch under the full moon, dark blue tones.
A vintage car parked in front of a brick house on a rainy street.
A ballerina dancing on a stage with a single spotlight above her.
A mountain lake reflecting tall pine trees and a cloudy sky.
A hand drawn map of a fantasy island with rivers, forests and towns.
A motorcycle racing on a desert road, motion blur, cinematic lighting.
A galaxy full of stars and purple nebula clouds in deep space.
A teddy bear sitting on a bed next to a window with morning light.
A comic book style hero with a red cape flying over the city.
A pixel art character walking through four different seasons.
A children's book illustration of a rabbit baking a carrot cake.
A sketch of a cathedral in black ink with fine line details.
A minimalist poster of a whale swimming in a dark blue ocean.
A photo of a coffee shop interior with plants, wooden chairs and lamps.
A macro photo of a bee on a purple flower, shallow depth of field.
A 3D render of a glass sphere on a marble floor, studio light.
A story in four scenes: a seed, a sprout, a young tree, a big tree.
The same character shown from the front, the side, the back and above.
A family of ducks crossing a country road on a sunny morning.
A samurai standing in a bamboo forest, ink wash painting style.
A street market in the evening with lanterns, food stalls and people.
A polar bear on floating ice under the northern lights.
A tea set on a tray with cookies and a small vase of roses.
A superhero team posing together on a rooftop at sunset.
A black and white photo of a jazz musician playing the saxophone.
An anime girl with long silver hair holding a glowing sword.
A cozy cabin in the woods covered in snow with smoke from the chimney.
A sailing ship on the open ocean with white sails and a blue flag.
A mechanic fixing an engine in a garage full of tools.
A parrot with bright green, red and yellow feathers on a perch.
A dessert of chocolate cake with strawberries and whipped cream.
A tiger walking through tall grass in the jungle, sharp focus.
A girl and her dog watching the stars from a hill at night.
A clock tower in an old town square, seen from below.
A farmer driving a red tractor across a golden wheat field.
A frog wearing a crown sitting on a lily pad in a pond.
A series of four images showing the same house in spring, summer, autumn and winter.
"""

_STYLES = """\
photo, photograph, photorealistic, realistic, cinematic, studio lighting, soft light, hard light
watercolor, watercolour, oil painting, acrylic, pencil sketch, ink drawing, charcoal, pastel
anime, manga, cartoon, comic, pixel art, low poly, 3D render, clay, papercut, flat design
vintage, retro, modern, minimalist, surreal, fantasy, sci-fi, steampunk, cyberpunk, gothic
bright, dark, warm, cool, vivid, muted, saturated, desaturated, monochrome, black and white
high detail, highly detailed, sharp focus, shallow depth of field, wide angle, close-up, macro
red, orange, yellow, green, blue, purple, pink, brown, black, white, grey, gray, gold, silver
morning, noon, afternoon, evening, night, sunrise, sunset, dawn, dusk, spring, summer, autumn, winter
front view, side view, back view, top view, full body, half body, portrait, landscape, scene
"""

_REASONS = """\
<reason>1. The two images show the same subject with the same identity, face and clothing. 2. The style, colour palette and lighting are consistent across both subfigures.</reason>
<reason>1. The two images differ in style: one is a photo and the other is a cartoon. 2. The identity of the subject does not match between the images.</reason>
<reason>1. The subject keeps the same structure, texture and color in both panels. 2. The background and the scene follow the same logic as the theme.</reason>
<reason>1. The brightness and contrast of the second image are very different from the first. 2. The edges and the texture of the subject are inconsistent.</reason>
<reason>1. Both subfigures share the same palette, brightness and contrast. 2. The character has the same hair, eyes and outfit, so the identity is preserved.</reason>
<reason>1. The second image shows a different animal, so the identity is not consistent. 2. The logic of the story is broken because the scene does not follow the theme.</reason>
<reason>1. The two images match in style, logic and identity. 2. Only the pose and the viewpoint change, which is expected for this theme.</reason>
<reason>1. The colors differ strongly and the texture is blurred in one image. 2. The structure of the object is not the same in the two subfigures.</reason>
The two images are consistent in terms of style, logic and identity.
The two images are inconsistent: the subject, the background and the colour palette differ.
The images maintain the same identity but the style is different.
The style is the same but the subject is a different person with a different face.
The image meets the criteria: it follows the prompt and shows every object that was asked for.
The image does not meet the criteria: an object is missing and the count is wrong.
Consistency means the same subject, the same style and a coherent logic across the set.
The subject, background, lighting, texture, structure and edges are compared one by one.
Identity, style, logic, colour, color, texture, structure, brightness, contrast, palette, edges.
consistent, inconsistent, consistency, inconsistency, subject, background, foreground, object.
differ, differs, different, difference, match, matches, matching, same, similar, identical.
"""

_RESPONSES = """\
Yes. <reason>1. The two images keep the same identity. 2. The style is consistent.</reason>
No. <reason>1. The two images differ in identity. 2. The style is not consistent.</reason>
Yes, the two images are consistent.
No, the two images are not consistent.
Answer: Yes
Answer: No
Yes
No
"""

_PUNCTUATION = """\
. , ; : ! ? ' " ( ) [ ] { } < > / \\ | - _ + = * & % $ # @ ~ ^ ` ... -- 1. 2. 3. 4. 5.
Hello, world! Is this a test? Yes: it is (a short one) -- and "quotes" work; so do 'single' ones.
It's the image's style; they're consistent; we've checked; I'm sure; you'll see; he'd agree.
"""


def _panel_lines() -> list[str]:
    """Grid prompts with panel tags, e.g. ``[TOP-LEFT] a red fox [TOP-RIGHT] ...``."""
    subjects = ("a red fox", "an astronaut", "an orange cat", "a young woman", "a small boat",
                "a robot", "a dragon", "a lighthouse", "a teddy bear", "a tiger")
    actions = ("standing", "running", "sitting", "sleeping", "looking up", "turning left",
               "in the rain", "at night", "in the snow", "under the sun")
    lines = []
    n = len(subjects)
    for i, subject in enumerate(subjects):
        tags = PANEL_TAGS[6:10] if i % 2 == 0 else PANEL_TAGS[:4]
        parts = [f"{tag} {subject} {actions[(i + k) % n]}" for k, tag in enumerate(tags)]
        lines.append(f"A 2x2 grid image set of {subject}. " + " ".join(parts))
    lines.append(" ".join(PANEL_TAGS))
    return lines


def _number_lines() -> list[str]:
    """Digits, small integers, sizes and ordinals."""
    lines = [" ".join(str(i) for i in range(0, 101))]
    lines.append("64 128 256 512 768 1024 2048 4096 64x64 128x128 256x256 512x512 1024x1024")
    lines.append("1x2 2x1 2x2 1x3 3x1 2x3 3x2 3x3 1x4 4x1 panel 1, panel 2, panel 3, panel 4")
    lines.append("one two three four five six seven eight nine ten first second third fourth")
    lines.append("0.1 0.2 0.5 1.0 1.5 2.0 10% 50% 100% #1 #2 #3 #4 No. 1 No. 2")
    return lines


def _template_lines() -> list[str]:
    """The two frozen judge templates, raw and filled with a few prompts and criteria (many times, so the
    answer words and frequent template words become single tokens)."""
    themes = [line.rstrip(".") for line in _PROMPTS.splitlines()[:24]]
    criteria = (
        "The image shows exactly four panels.",
        "The subject is the same in every panel.",
        "The colour palette is consistent across the set.",
        "The background matches the theme.",
        "Every object in the prompt is present.",
        "The text in the image is readable.",
    )
    lines = [PAIRWISE_TEMPLATE, CRITERIA_TEMPLATE]
    for i, theme in enumerate(themes):
        lines.append(PAIRWISE_TEMPLATE.format(main_prompt=theme))
        lines.append(("Yes. " if i % 2 == 0 else "No. ") + _REASONS.splitlines()[i % 8])
    for i, crit in enumerate(criteria):
        lines.append(CRITERIA_TEMPLATE.format(criteria=crit))
        lines.append("Yes" if i % 2 == 0 else "No")
    return lines


def corpus_lines() -> list[str]:
    """The corpus as a list of non-empty lines, in a fixed order.

    Returns:
        About 250 lines (~40 KB) of English text. Identical on every call.
    """
    blocks = [_PROMPTS, _STYLES, _REASONS, _RESPONSES, _PUNCTUATION]
    lines: list[str] = []
    for block in blocks:
        lines.extend(line for line in block.splitlines() if line.strip())
    lines.extend(_panel_lines())
    lines.extend(_number_lines())
    lines.extend(_template_lines())
    # Chat-formatted answers: the answer word right after "assistant\n" and after a space.
    for word in ("Yes", "No"):
        lines.extend([word, f" {word}", f"{word}.", f" {word}.", f"Answer {word} first."] * 4)
    return lines


def corpus_text() -> str:
    """The corpus joined with newlines (with a trailing newline)."""
    return "\n".join(corpus_lines()) + "\n"
